"""GPU telemetry: NVML records and dcgm-exporter pages become the same samples (dcgm-exporter's
names and units), the live collector stores them on the server session running then, and the
reports turn them into mean power, utilisation and energy per output token and per request,
with intervals and verdicts in a diff. CI has no GPU: NVML's records and dcgm-exporter's page
come from files recorded on a GPU server (tests/fixtures/gpu/: hand-written until recorded,
see its README); everything past the NVML calls is the code that runs there.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

import duckdb
import pytest

from servescope.collector import gpu
from servescope.store import Store
from servescope.store.settings import free_port
from tests.helpers.cli import ROOT, SERVESCOPE, servescope
from tests.helpers.gpu_recordings import FIXTURES, nvml_records


def test_without_a_gpu_the_collector_says_so_in_one_line(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("")
    on = servescope("collect", "--vllm-log", str(log), "--gpu", "on", "--metrics-port", "0",
                    "--store", str(tmp_path / "s.duckdb"), timeout=180)  # fmt: skip
    assert on.returncode == 2 and "no GPU" in on.stderr and "Traceback" not in on.stderr
    assert len(on.stderr.strip().splitlines()) == 1


def test_the_live_collector_stores_dcgm_samples_on_the_running_session(
    tmp_path: Path, dcgm_exporter: str
) -> None:
    lines = (FIXTURES / "vllm-h100.log").read_text().splitlines()
    end = next(i for i, line in enumerate(lines) if "shutdown triggered" in line)
    log = tmp_path / "vllm.log"
    log.write_text("\n".join(lines[:end]) + "\n")  # a server still running
    store = tmp_path / "s.duckdb"
    url = f"{dcgm_exporter}/metrics"
    proc = subprocess.Popen(
        [*SERVESCOPE, "collect", "--vllm-log", str(log), "--dcgm-url", url, "--scrape-interval",
         "0.2", "--metrics-port", str(free_port()), "--store", str(store)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        found = 0
        while time.monotonic() < deadline and found < 3:
            time.sleep(1)
            if store.exists():
                with Store(store).read() as con:
                    row = con.execute(
                        "SELECT count(*) FROM metric_samples WHERE name = $n", {"n": gpu.POWER}
                    ).fetchone()
                found = row[0] if row else 0
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, output
    assert f"GPU telemetry: scraping dcgm-exporter at {url}" in output
    with duckdb.connect(str(store), read_only=True) as con:
        rows = con.execute(
            "SELECT DISTINCT name, run_id, target FROM metric_samples WHERE name LIKE 'DCGM_%'"
        ).fetchall()
        session = con.execute("SELECT run_id FROM runs").fetchone()
    assert {r[0] for r in rows} == {gpu.POWER, gpu.ENERGY, gpu.FB_USED, gpu.GPU_UTIL,
                                    gpu.MEM_COPY_UTIL, gpu.SM_CLOCK}  # fmt: skip
    assert {r[1] for r in rows} == {session[0]} and {r[2] for r in rows} == {url}


def _run_over(records: list[dict], run_id: str, start: int, stop: int, tokens: int) -> list[str]:
    """Requests of a run spread over records[start:stop] (one a second, `tokens` output
    tokens each), as `.events.jsonl` lines."""
    out = []
    for i, rec in enumerate(records[start:stop]):
        ts = datetime.fromtimestamp(float(rec["ts"]), UTC).replace(tzinfo=None).isoformat() + "Z"
        out.append(json.dumps({
            "request_id": f"{run_id}-{i:06d}", "run_id": run_id, "ts": ts, "status": "ok",
            "prompt_tokens": 2015, "completion_tokens": tokens, "ttft_ms": 40.0 + i % 7,
            "tpot_ms": 8.0, "e2e_ms": 900.0,
        }))  # fmt: skip
    return out


def _store_with_two_runs(tmp_path: Path) -> Path:
    records = nvml_records()
    store_path = tmp_path / "s.duckdb"
    events = tmp_path / "runs.events.jsonl"
    n = len(records)
    lines = _run_over(records, "run-a", n // 6, n // 2, 64) + _run_over(
        records, "run-b", n // 2, 5 * n // 6, 128
    )
    events.write_text("\n".join(lines) + "\n")
    servescope("store", "import", str(events), "--store", str(store_path), check=True)
    store = Store(store_path)
    # the sidecar stored the GPU as no session's: both runs read it by time
    store.add_metric_samples([s for rec in records for s in gpu.samples_of(rec)])
    return store_path


def test_a_report_gives_power_utilisation_and_energy_per_token(tmp_path: Path) -> None:
    store = _store_with_two_runs(tmp_path)
    out = tmp_path / "r"
    built = servescope("report", "build", "run-a", "--format", "json,md", "--out", str(out),
                       "--store", str(store), "--json", check=True)  # fmt: skip
    paths = [Path(p) for p in json.loads(built.stdout)["paths"]]
    report = json.loads(next(p for p in paths if p.suffix == ".json").read_text())
    g = report["gpu"]
    assert g["measured"] and g["gpus"] == 1 and g["energy_basis"] == "energy counter"
    tokens = report["overall"]["throughput"]["output_tokens_per_s"] * report["overall"][
        "throughput"]["duration_s"]  # fmt: skip
    assert g["j_per_output_token"] == pytest.approx(g["energy_j"] / tokens)
    assert g["j_per_request"] == pytest.approx(g["energy_j"] / report["overall"]["requests"])
    # the counter and the power readings tell the same story (two sensors, one GPU)
    assert g["mean_power_w"] == pytest.approx(g["sampled_power_w"], rel=0.1)
    assert 0 < g["gpu_util_pct"] <= 100 and g["fb_used_mib_peak"] > 1000
    markdown = next(p for p in paths if p.suffix == ".md").read_text()
    assert "J per output token" in markdown
    assert g["devices"] == ["NVIDIA H100 80GB HBM3"]  # the recorded GPU names itself
    assert "GPU (1 GPU: NVIDIA H100 80GB HBM3, over the throughput window)" in markdown


def test_a_diff_tests_energy_per_token_like_throughput(tmp_path: Path) -> None:
    store = _store_with_two_runs(tmp_path)
    out = str(tmp_path / "r")
    built = servescope("report", "build", "run-b", "--vs", "run-a", "--format", "json",
                       "--out", out, "--store", str(store), "--json", check=True)  # fmt: skip
    report = json.loads(Path(json.loads(built.stdout)["paths"][0]).read_text())
    rows = {r["metric"]: r for r in report["diff"]}
    energy = rows["gpu.j_per_output_token"]
    assert energy["before"] == report["before"]["gpu"]["j_per_output_token"]
    assert energy["after"] == report["after"]["gpu"]["j_per_output_token"]
    assert energy["ci95"] is not None and energy["ci95"][0] <= energy["delta"] <= energy["ci95"][1]
    assert energy["verdict"] in ("improved", "regressed", "unchanged")
    for metric in ("gpu.mean_power_w", "gpu.gpu_util_pct", "gpu.j_per_request"):
        assert rows[metric]["verdict"] != "not measured"
    assert "energy per output token" in report["headline"]


def test_without_gpu_samples_the_report_says_so_in_one_line(tmp_path: Path) -> None:
    events = tmp_path / "e.events.jsonl"
    events.write_text("\n".join(_run_over(nvml_records(), "run-c", 0, 30, 16)) + "\n")
    store = tmp_path / "s.duckdb"
    servescope("store", "import", str(events), "--store", str(store), check=True)
    out = str(tmp_path / "r")
    built = servescope("report", "build", "run-c", "--format", "json,md", "--out", out,
                       "--store", str(store), "--json", check=True)  # fmt: skip
    paths = [Path(p) for p in json.loads(built.stdout)["paths"]]
    report = json.loads(next(p for p in paths if p.suffix == ".json").read_text())
    assert report["gpu"] == {"measured": False, "gpus": 0}
    markdown = next(p for p in paths if p.suffix == ".md").read_text()
    assert [line for line in markdown.splitlines()
            if line.startswith("GPU: no samples in this run's window")]  # fmt: skip
