"""A server killed mid-run: its own real vLLM (not the session's), killed with SIGKILL while a
closed-loop run is going. The run must record the failures with their classes and exit 1."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from servescope.loadgen.launcher import VllmServer
from servescope.store import Store, settings
from servescope.store.settings import free_port
from tests.helpers.cli import ROOT, SERVESCOPE, bench_args, read_events


def test_a_server_killed_mid_run_gives_error_events_and_exit_1(
    tiny_model: Path, tmp_path: Path
) -> None:
    config = tmp_path / "w.yaml"
    config.write_text(
        "workloads:\n"
        "  - {name: doomed, input_tokens: 64, output_tokens: 32, concurrency: [4],"
        " requests_per_level: 200}\n"
    )
    store = tmp_path / "s.duckdb"
    run_id = "run-20261122-killed"
    events_file = settings.events_dir() / f"{run_id}.events.jsonl"
    events_file.unlink(missing_ok=True)
    server = VllmServer(
        tiny_model, port=free_port(), served_name="tiny", log_path=tmp_path / "vllm.log"
    )
    with server:
        bench = subprocess.Popen(
            [
                *SERVESCOPE,
                *bench_args(config, server.url, run_id, store),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if events_file.exists() and len(events_file.read_text().splitlines()) >= 8:
                break
            time.sleep(0.2)
        assert server.process is not None
        os.killpg(server.process.pid, signal.SIGKILL)  # the whole server, engine included
        _, stderr = bench.communicate(timeout=120)
    assert bench.returncode == 1
    assert "requests failed" in stderr and "connect" in stderr
    events = Store(store).export_events(run_id)
    assert len(events) == 200 == len(read_events(events_file))
    ok = [e for e in events if e["status"] == "ok"]
    failed = [e for e in events if e["status"] != "ok"]
    assert len(ok) >= 8 and failed
    assert all(e["status"] == "error" and e["finish_reason"] == "error" for e in failed)
    assert {e["error"] for e in failed} <= {"connect", "disconnect"}
    assert "connect" in {e["error"] for e in failed}
    run = Store(store).run(run_id)
    assert run["notes"]["errors_by_class"]["connect"] >= 1
