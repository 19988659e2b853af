"""Energy per server, not per host: the collector's GPU source reads two GPUs whose NVML rows
were recorded on a GPU server while two servers' processes run here (each an API server
listening on its port with an engine-core child), and gives each GPU's samples to the session
whose processes compute on it; a fleet report then gives each replica the energy of its own
GPU, per output token and per request. CI has no GPU: NVML's rows are replayed from
tests/fixtures/gpu/ (the NVML boundary, `GpuSource.nvml`), every step after it is the code that
runs on a GPU server.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from servescope.collector import gpu
from servescope.dashboards import DASHBOARDS, dashboard_json
from servescope.dashboards.lint import queries, substitute
from servescope.store import Store
from servescope.store.settings import free_port
from tests.helpers.cli import ROOT, SERVESCOPE, servescope

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
                      "0", "--store", str(tmp_path / "s.duckdb"), timeout=180)  # fmt: skip
    assert done.returncode == 2 and "'first'" in done.stderr and "Traceback" not in done.stderr


# -- the dashboard's joules per output token, per server, from a real Prometheus ---------------

# A vLLM stand-in: its /metrics counts generated tokens at a steady rate; CUDA_VISIBLE_DEVICES
# (set by the test) is what places it on its GPU, as dcgm-exporter lists no processes.
VLLM = """
import http.server, sys, time
port, rate, t0 = int(sys.argv[1]), float(sys.argv[2]), time.time()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ('# TYPE vllm:generation_tokens counter\\n'
                f'vllm:generation_tokens_total{{model_name="m"}} {rate * (time.time() - t0)}\\n')
        self.send_response(200); self.end_headers(); self.wfile.write(body.encode())
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""
WATTS = {"0": 300.0, "1": 150.0}
TOKENS_PER_S = (100.0, 25.0)  # server a on GPU 0: 3 J a token; server b on GPU 1: 6 J a token


class DcgmPage(http.server.BaseHTTPRequestHandler):
    """dcgm-exporter's recorded page for two GPUs (the recorded one and a copy as GPU 1), each
    energy counter growing at its GPU's power."""

    t0 = time.time()

    def do_GET(self) -> None:  # noqa: N802
        page = (FIXTURES / "dcgm-exporter.txt").read_text()
        uuid0 = re.search(r'UUID="([^"]+)"', page)
        assert uuid0 is not None
        lines = []
        for index, uuid in (("0", uuid0.group(1)), ("1", UUID_1)):
            for line in page.splitlines():
                if line.startswith("#"):
                    continue
                line = line.replace('gpu="0"', f'gpu="{index}"').replace(uuid0.group(1), uuid)
                if line.startswith(gpu.ENERGY):
                    grown = WATTS[index] * 1000 * (time.time() - self.t0)
                    line = f"{line.rsplit(' ', 1)[0]} {5e10 + grown:.0f}"
                lines.append(line)
        body = ("\n".join(lines) + "\n").encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:
        return


def _log_of(port: int, path: Path) -> Path:
    """The recorded server's first lifetime, started on `port` and still running."""
    lines = (FIXTURES / "vllm-h100.log").read_text().splitlines()
    end = next(i for i, line in enumerate(lines) if "shutdown triggered" in line)
    text = "\n".join(lines[:end]) + "\n"
    text = text.replace("{'host': '127.0.0.1', ", f"{{'host': '127.0.0.1', 'port': {port}, ")
    path.write_text(text.replace("http://127.0.0.1:8000", f"http://127.0.0.1:{port}"))
    return path


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def test_the_dashboard_gives_each_server_its_own_joules_per_token(tmp_path: Path) -> None:
    expr = next(
        q.expr
        for q in queries(dashboard_json(DASHBOARDS["servescope-vllm"]))
        if "servescope_gpu_server_info" in q.expr
    )
    page = http.server.ThreadingHTTPServer(("127.0.0.1", 0), DcgmPage)
    threading.Thread(target=page.serve_forever, daemon=True).start()
    dcgm = f"127.0.0.1:{page.server_address[1]}"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        ports = []
        for visible, rate in zip(("0", UUID_1), TOKENS_PER_S, strict=True):
            port = free_port()
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible}
            procs.append(subprocess.Popen(
                [sys.executable, "-c", VLLM, str(port), str(rate)], env=env
            ))  # fmt: skip
            ports.append(port)
        logs = [_log_of(p, tmp_path / f"{i}.log") for i, p in enumerate(ports)]
        collector = free_port()
        procs.append(subprocess.Popen(
            [*SERVESCOPE, "collect", *(a for log in logs for a in ("--vllm-log", str(log))),
             "--dcgm-url", f"http://{dcgm}/metrics", "--scrape-interval", "0.5",
             "--metrics-port", str(collector), "--store", str(tmp_path / "s.duckdb")],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ))  # fmt: skip
        targets = [dcgm, f"127.0.0.1:{collector}", *(f"127.0.0.1:{p}" for p in ports)]
        config = {
            "global": {"scrape_interval": "1s"},
            "scrape_configs": [{"job_name": "all", "static_configs": [{"targets": targets}]}],
        }
        (tmp_path / "prometheus.yml").write_text(json.dumps(config))
        prom_port = free_port()
        procs.append(subprocess.Popen(
            [str(shutil.which("prometheus")), f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ))  # fmt: skip
        # Rates over 1 s scrapes wobble with when each scrape lands on a busy machine. So each
        # reading is checked against the parts Prometheus itself rates from the same samples in
        # the same query (each GPU's energy, each server's tokens): exact. Against the stand-ins'
        # own figures, the median of five readings a server, within the wobble.
        window = "10s"
        parts = (
            f'label_replace(sum by (gpu) (rate({gpu.ENERGY}[{window}])), "part", "energy", "", "")'
            f" or label_replace(sum by (instance) (rate(vllm:generation_tokens_total[{window}])),"
            ' "part", "tokens", "", "")'
        )
        query = urllib.parse.quote(f"({substitute(expr, rate_interval=window)}) or {parts}")
        gpu_of = {f"127.0.0.1:{p}": index for p, index in zip(ports, WATTS, strict=True)}
        deadline, readings = time.monotonic() + 180, {}
        checked: list[tuple[str, float, float]] = []  # (server, panel, its GPU's J / its tokens)
        while time.monotonic() < deadline and (
            len(readings) < 2 or min(len(v) for v in readings.values()) < 5
        ):
            time.sleep(1)
            try:
                data = _get(f"http://127.0.0.1:{prom_port}/api/v1/query?query={query}")
            except OSError:
                continue
            result = data["data"]["result"]
            energy = {r["metric"]["gpu"]: float(r["value"][1]) for r in result
                      if r["metric"].get("part") == "energy"}  # fmt: skip
            tokens = {r["metric"]["instance"]: float(r["value"][1]) for r in result
                      if r["metric"].get("part") == "tokens"}  # fmt: skip
            for r in result:
                if "part" in r["metric"]:
                    continue
                server, value = r["metric"]["server"], float(r["value"][1])
                readings.setdefault(server, []).append(value)
                checked.append((server, value, energy[gpu_of[server]] / 1000 / tokens[server]))
        found = {server: statistics.median(values) for server, values in readings.items()}
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(timeout=30)
        page.shutdown()
    assert found.keys() == {f"127.0.0.1:{p}" for p in ports}, found
    for server, value, own in checked:  # each server's GPU's energy over its own tokens
        assert value == pytest.approx(own, rel=1e-6), (server, value, own)
    # 3 and 6 J a token, within the wobble: the other GPU's energy, or the other server's
    # tokens, would be off by half or more
    assert found[f"127.0.0.1:{ports[0]}"] == pytest.approx(3.0, rel=0.4)
    assert found[f"127.0.0.1:{ports[1]}"] == pytest.approx(6.0, rel=0.4)
