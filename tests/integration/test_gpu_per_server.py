"""Energy per server, not per host: the collector's GPU source reads two GPUs whose NVML rows
were recorded on a GPU server while two servers' processes run here (each an API server
listening on its port with an engine-core child), and gives each GPU's samples to the session
whose processes compute on it; a fleet report then gives each replica the energy of its own
GPU, per output token and per request. CI has no GPU: NVML's rows are replayed from
tests/fixtures/gpu/ (the NVML boundary, `GpuSource.nvml`), every step after it is the code that
runs on a GPU server.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from servescope.collector import gpu
from servescope.store import Store
from tests.conftest import free_port, servescope

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gpu"
UUID_1 = "GPU-00000000-0000-0000-0000-000000000001"
# An API server: listens on its port and starts an engine core, as vLLM's does.
SERVER = """
import socket, subprocess, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen()
core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(core.pid, flush=True)
time.sleep(600)
"""


def _records() -> list[dict[str, Any]]:
    lines = (FIXTURES / "nvml-samples.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _second_gpu(row: dict[str, Any]) -> dict[str, Any]:
    """The recorded GPU as a second one: its own index and UUID, a tenth less power."""
    return {**row, "gpu": 1, "uuid": UUID_1, "power_mw": int(row["power_mw"] * 0.9),
            "energy_mj": int(row["energy_mj"] * 0.9)}  # fmt: skip


@pytest.fixture
def servers() -> Iterator[list[tuple[int, int]]]:
    """Two running servers: (port, engine core pid) each."""
    started = []
    try:
        for _ in range(2):
            port = free_port()
            proc = subprocess.Popen(
                [sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE, text=True
            )
            assert proc.stdout is not None
            started.append((proc, port, int(proc.stdout.readline())))
        yield [(port, core) for _proc, port, core in started]
    finally:
        for proc, _port, core in started:
            subprocess.run(["kill", str(core)], check=False)
            proc.kill()
            proc.wait()


@dataclass
class Running:
    """A running server session as the collector knows it (`collector.sessions.Session`)."""

    run_id: str | None
    target: str | None


def test_each_gpu_goes_to_the_session_whose_processes_use_it(
    servers: list[tuple[int, int]],
) -> None:
    (port_a, core_a), (port_b, core_b) = servers
    row = _records()[len(_records()) // 2]
    rows = [{**row, "processes": [{"pid": core_a, "used_bytes": 2**34}]},
            {**_second_gpu(row), "processes": [{"pid": core_b, "used_bytes": 2**34}]}]  # fmt: skip
    source = gpu.GpuSource(nvml=lambda: rows)
    a = Running("vllm-a", f"http://127.0.0.1:{port_a}")
    b = Running("vllm-b", f"http://127.0.0.1:{port_b}")
    samples = source.read(lambda: [a, b])
    stored = {(s[3]["UUID"], s[4]) for s in samples}
    assert stored == {(row["uuid"], "vllm-a"), (UUID_1, "vllm-b")}
    assert source.owned == {("0", row["uuid"]): a.target, ("1", UUID_1): b.target}
    # one sidecar per replica: a's collector stores a's GPU only
    assert {(s[3]["UUID"], s[4]) for s in source.read(lambda: [a])} == {(row["uuid"], "vllm-a")}
    # the engine core of b computes on GPU 0 too: GPU 0 is no one server's
    rows[0]["processes"].append({"pid": core_b})
    assert {(s[3]["UUID"], s[4]) for s in source.read(lambda: [a, b])} == {
        (row["uuid"], None), (UUID_1, "vllm-b")
    }  # fmt: skip


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).replace(tzinfo=None).isoformat() + "Z"


def test_a_fleet_report_gives_each_replica_its_own_gpus_energy(tmp_path: Path) -> None:
    """Replica a on GPU 0, replica b on GPU 1 (stored as the collector attributes them); b
    serves twice a's output tokens."""
    records = _records()
    n = len(records)
    store_path = tmp_path / "s.duckdb"
    lines = []
    for i, rec in enumerate(records[n // 6 : n // 2]):
        replica = "a" if i % 2 == 0 else "b"
        lines.append(json.dumps({
            "request_id": f"run-fleet-{i:06d}", "run_id": "run-fleet", "ts": _iso(rec["ts"]),
            "status": "ok", "prompt_tokens": 100, "completion_tokens": 64 if replica == "a"
            else 128, "ttft_ms": 40.0, "tpot_ms": 8.0, "e2e_ms": 500.0, "upstream": replica,
            "routing": "round-robin", "vllm_session": f"vllm-{replica}",
        }))  # fmt: skip
    events = tmp_path / "fleet.events.jsonl"
    events.write_text("\n".join(lines) + "\n")
    servescope("store", "import", str(events), "--store", str(store_path), check=True)
    store = Store(store_path)
    store.add_metric_samples(
        [s for rec in records for s in gpu.samples_of(rec, run_id="vllm-a")]
        + [s for rec in records for s in gpu.samples_of(_second_gpu(rec), run_id="vllm-b")]
    )
    out = tmp_path / "r"
    built = servescope("report", "build", "run-fleet", "--format", "json,md", "--out", str(out),
                       "--store", str(store_path), "--json", check=True)  # fmt: skip
    paths = [Path(p) for p in json.loads(built.stdout)["paths"]]
    report = json.loads(next(p for p in paths if p.suffix == ".json").read_text())
    by = {r["replica"]: r for r in report["replicas"]}
    ga, gb = by["a"]["gpu"], by["b"]["gpu"]
    assert ga["gpu_ids"] == [records[0]["uuid"]] and gb["gpu_ids"] == [UUID_1]
    assert gb["energy_j"] == pytest.approx(0.9 * ga["energy_j"], rel=0.02)
    tokens_a = sum(64 for i in range(len(lines)) if i % 2 == 0)
    assert ga["j_per_output_token"] == pytest.approx(ga["energy_j"] / tokens_a)
    assert by["a"]["j_per_output_token"] == ga["j_per_output_token"]
    # b: 0.9 of the energy over twice the tokens
    assert gb["j_per_output_token"] < 0.5 * ga["j_per_output_token"]
    # the run's figure holds both GPUs
    assert report["gpu"]["gpus"] == 2
    assert report["skew"]["j_per_output_token"]["n"] == 2
    markdown = next(p for p in paths if p.suffix == ".md").read_text()
    assert "| GPU energy by replica |" in markdown and UUID_1 in markdown


def test_collect_refuses_a_gpu_it_cannot_name(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("")
    done = servescope("collect", "--vllm-log", str(log), "--gpu", "0,first", "--metrics-port",
                      "0", "--store", str(tmp_path / "s.duckdb"), timeout=60)  # fmt: skip
    assert done.returncode == 2 and "'first'" in done.stderr and "Traceback" not in done.stderr
