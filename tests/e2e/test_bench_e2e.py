"""bench → events file + store → report, against the session's real vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.cli import bench_args, read_events, servescope
from tests.helpers.stats import percentile
from tests.helpers.vllm import RunningServer

WORKLOAD = """
workloads:
  - {name: short-short, input_tokens: 96, output_tokens: 12, concurrency: [1, 4]}
  - {name: long-short, input_tokens: 700, output_tokens: 8, concurrency: [2]}
metrics: [ttft_ms, tpot_ms, qps, tokens_per_second, memory_peak_gb]
requests_per_level: 8
"""


@pytest.fixture(scope="module")
def bench_run(vllm_server: RunningServer, tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("bench")
    config = folder / "w.yaml"
    config.write_text(WORKLOAD)
    store = folder / "s.duckdb"
    run_id = "run-20261122-e2e"
    result = servescope(
        *bench_args(config, vllm_server.url, run_id, store),
        "--json",
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    out = folder / "reports"
    built = servescope(
        "report", "build", run_id, "--store", str(store), "--out", str(out), check=True
    )
    return {
        "run_id": run_id,
        "summary": summary,
        "store": store,
        "reports": out,
        "printed": built.stdout.split(),
        "events": read_events(Path(summary["events_path"])),
    }


def test_one_event_per_request_with_exact_prompt_sizes(bench_run: dict) -> None:
    events = bench_run["events"]
    assert len(events) == 24 == bench_run["summary"]["events"]
    assert len({e["request_id"] for e in events}) == 24
    assert sorted(e["request_id"] for e in events) == [
        f"run-20261122-e2e-{i:06d}" for i in range(1, 25)
    ]
    expected = {"short-short": (96, 12), "long-short": (700, 8)}
    for event in events:
        assert event["status"] == "ok", event
        assert (event["prompt_tokens"], event["completion_tokens"]) == expected[event["workload"]]
        assert event["ttft_ms"] > 0
        # one gap per SSE message; vLLM merges tokens into one message when its reader lags (on a
        # busy machine a whole answer in one message: no gap at all)
        assert len(event["itl_ms"]) <= event["completion_tokens"] - 1
        # a stream whose tokens all arrived in one read (every gap 0) shows no decode: TPOT null
        assert (event["tpot_ms"] is not None) == any(event["itl_ms"]), event
        if event["tpot_ms"] is not None:
            rebuilt = event["ttft_ms"] + event["tpot_ms"] * (event["completion_tokens"] - 1)
            assert rebuilt == pytest.approx(event["e2e_ms"], rel=1e-9)
        assert event["e2e_ms"] >= event["ttft_ms"] + sum(event["itl_ms"]) - 1e-6


def test_report_overall_equals_an_independent_computation(bench_run: dict) -> None:
    report_dir = bench_run["reports"] / bench_run["run_id"]
    assert [Path(p).name for p in bench_run["printed"]] == [
        "index.html",
        "report.md",
        "report.json",
    ]
    report = json.loads((report_dir / "report.json").read_text())
    events = bench_run["events"]
    overall = report["overall"]
    assert overall["requests"] == 24 and overall["errors"] == 0 and overall["error_rate"] == 0
    for metric in ("ttft_ms", "tpot_ms", "e2e_ms"):
        values = [e[metric] for e in events if e.get(metric) is not None]  # TPOT: not at once
        for name, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99)):
            assert overall[metric][name] == pytest.approx(percentile(values, q), rel=1e-9), (
                metric,
                name,
            )
        assert overall[metric]["mean"] == pytest.approx(sum(values) / len(values), rel=1e-9)
    at_once = sum(1 for e in events if e["tpot_ms"] is None)
    assert overall["one_chunk_streams"]["streams"] == at_once
    assert overall["queue_ms"]["p50"] is None
    assert overall["throughput"]["output_tokens_per_s"] > 0
    groups = {(g["workload"], g["concurrency"]): g["requests"] for g in report["groups"]}
    assert groups == {("long-short", 2): 8, ("short-short", 1): 8, ("short-short", 4): 8}
    assert report["levers"]["enable_log_requests"] is True
    assert report["run"]["vllm_version"] == "0.32.0"
    assert report["run"]["memory_peak_gb"] > 0


def test_store_holds_the_same_events_as_the_file(bench_run: dict) -> None:
    exported = bench_run["store"].parent / "export.events.jsonl"
    servescope(
        "store",
        "export",
        bench_run["run_id"],
        "--out",
        str(exported),
        "--store",
        str(bench_run["store"]),
        check=True,
    )
    by_id = {e["request_id"]: e for e in bench_run["events"]}
    again = read_events(exported)
    assert len(again) == len(by_id)
    for event in again:
        assert event == by_id[event["request_id"]]
