"""The run summary's fields beyond the skeleton: errors by class, ITL, server-side phases,
goodput, server counters and gauges, admission rejections per team and reason, and the
pass criteria — each checked against a plain computation over the stored data."""

from __future__ import annotations

import json
import math
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from servescope.store import Store
from tests.helpers.cli import servescope
from tests.helpers.stats import percentile

T0 = datetime(2026, 11, 22, 5, 0, 0)
RUN = "run-20261122-summary"
SPEC = {
    "workloads": [
        {"name": "chat-w", "input_tokens": 64, "output_tokens": 8, "concurrency": [2],
         "endpoint": "chat"},
        {"name": "flood", "input_tokens": 64, "output_tokens": 8, "concurrency": [4],
         "endpoint": "completions"},
    ]
}  # fmt: skip


def events() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(**fields: Any) -> None:
        i = len(out)
        ttft = 40.0 + 13.0 * (i % 7)
        base = {
            "request_id": f"{RUN}-{i + 1:06d}",
            "ts": (T0 + timedelta(milliseconds=200 * i)).isoformat() + "Z",
            "model": "tiny",
            "prompt_tokens": 64,
            "completion_tokens": 8,
            "ttft_ms": ttft,
            "tpot_ms": 10.0 + (i % 3),
            "e2e_ms": ttft + (10.0 + (i % 3)) * 7,
            "itl_ms": [9.0 + (i % 3), 10.0, 11.0 + (i % 5)],
            "queue_ms": 1.0 + i,
            "prefill_ms": 20.0 + (i % 4),
            "decode_ms": 70.0 + (i % 6),
            "cached_tokens": 32 if i % 2 else 0,
            "status": "ok",
            "finish_reason": "length",
        }
        base.update(fields)
        out.append({k: v for k, v in base.items() if v is not None})

    for _ in range(20):
        add(workload="chat-w", concurrency=2, team="b")
    for _ in range(5):
        add(workload="flood", concurrency=4, team="a")
    for _ in range(6):
        add(workload="flood", concurrency=4, team="a", status="rejected",
            error="rejected:queue_full", http_status=429, ttft_ms=None, tpot_ms=None,
            itl_ms=None, completion_tokens=None, prompt_tokens=None, queue_ms=None,
            prefill_ms=None, decode_ms=None, cached_tokens=None, finish_reason="error")  # fmt: skip
    add(workload="flood", concurrency=4, status="timeout", error="timeout", ttft_ms=None,
        tpot_ms=None, itl_ms=None, completion_tokens=None, finish_reason="error")  # fmt: skip
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("summary")
    db = folder / "s.duckdb"
    store = Store(db)
    evs = events()
    store.add_events([{**e, "run_id": RUN} for e in evs])
    store.upsert_run(
        RUN,
        model="tiny",
        vllm_version="0.32.0",
        levers={"max_num_seqs": 4},
        workload=SPEC,
        notes={"cold_start_s": 81.5, "warm_restart_s": 31.25, "server_ready_s": 31.25},
    )
    samples = []
    for k, (kv, pre, running) in enumerate([(0.2, 3, 1), (0.7, 4, 4), (0.5, 5, 2)]):
        ts = T0 + timedelta(seconds=2 * k)
        samples += [
            (ts, "vllm", "vllm:kv_cache_usage_perc", {"engine": "0"}, RUN, kv),
            (ts, "vllm", "vllm:num_preemptions_total", {"engine": "0"}, RUN, float(pre)),
            (ts, "vllm", "vllm:num_requests_running", {"engine": "0"}, RUN, float(running)),
        ]
    store.add_metric_samples(samples)
    out = folder / "r"
    servescope(
        "report", "build", RUN, "--store", str(db), "--out", str(out), "--slo", "ttft_ms=80",
        "--gpu-hour-usd", "2.5", "--api-usd-per-1k-tokens", "0.002", check=True,
    )  # fmt: skip
    return {
        "events": evs,
        "report": json.loads((out / RUN / "report.json").read_text()),
        "html": (out / RUN / "index.html").read_text(),
        "md": (out / RUN / "report.md").read_text(),
    }


def test_latency_phases_and_itl_match_a_plain_computation(built: dict[str, Any]) -> None:
    overall = built["report"]["overall"]
    ok = [e for e in built["events"] if e["status"] == "ok"]
    for metric in ("ttft_ms", "tpot_ms", "e2e_ms", "queue_ms", "prefill_ms", "decode_ms"):
        values = [e[metric] for e in ok]
        for name, q in (("p50", 0.5), ("p90", 0.9), ("p95", 0.95), ("p99", 0.99)):
            assert overall[metric][name] == pytest.approx(percentile(values, q), rel=1e-9)
    gaps = [g for e in ok for g in e["itl_ms"]]
    assert overall["itl_ms"]["p95"] == pytest.approx(percentile(gaps, 0.95), rel=1e-9)
    assert overall["itl_ms"]["mean"] == pytest.approx(sum(gaps) / len(gaps), rel=1e-9)


def test_errors_rejections_and_teams(built: dict[str, Any]) -> None:
    report = built["report"]
    overall = report["overall"]
    assert overall["requests"] == 32 and overall["errors"] == 7 and overall["rejected"] == 6
    assert overall["error_rate"] == pytest.approx(7 / 32)
    assert overall["errors_by_class"] == {"rejected:queue_full": 6, "timeout": 1}
    assert report["admission"]["rejections"] == [{"team": "a", "reason": "queue_full", "n": 6}]
    teams = {t["team"]: t for t in report["admission"]["teams"]}
    assert (teams["a"]["ok"], teams["a"]["rejected"]) == (5, 6)
    assert (teams["b"]["ok"], teams["b"]["rejected"], teams["b"]["failed"]) == (20, 0, 0)
    groups = {(g["workload"], g["concurrency"]): g for g in report["groups"]}
    assert groups[("flood", 4)]["errors_by_class"] == {"rejected:queue_full": 6, "timeout": 1}
    assert groups[("chat-w", 2)]["errors_by_class"] == {}


def test_goodput_cache_and_server_numbers(built: dict[str, Any]) -> None:
    report = built["report"]
    ok = [e for e in built["events"] if e["status"] == "ok"]
    good = [e for e in ok if e["ttft_ms"] <= 80]
    goodput = report["overall"]["goodput"]
    assert goodput["slo"] == {"ttft_ms": 80.0}
    assert goodput["good_requests"] == len(good)
    assert goodput["ratio"] == pytest.approx(len(good) / 32)
    seconds = report["overall"]["throughput"]["duration_s"]
    assert goodput["requests_per_s"] == pytest.approx(len(good) / seconds)
    cached = [e for e in built["events"] if "cached_tokens" in e]
    assert report["overall"]["cached_token_ratio"] == pytest.approx(
        sum(e["cached_tokens"] for e in cached) / sum(e["prompt_tokens"] for e in cached)
    )
    server = report["server"]
    assert server["kv_cache_usage_peak"] == 0.7
    assert server["preemptions"] == 2
    assert server["running_peak"] == 4
    assert server["prefix_cache_hit_ratio"] is None  # never scraped: null, not 0
    assert server["waiting_peak"] is None
    assert "not measured" in built["html"]


def test_the_seeds_pass_criteria(built: dict[str, Any]) -> None:
    checks = {c["item"]: c for c in built["report"]["checklist"]}
    assert checks["Model loading"]["status"] == "pass"
    assert "cold start 81.5 s" in checks["Model loading"]["evidence"]
    assert "warm restart 31.2 s" in checks["Model loading"]["evidence"]
    assert checks["API compatibility"]["status"] == "pass"
    assert checks["API compatibility"]["evidence"] == "20 of 20 chat calls succeeded"
    # 1 timeout in 32 requests = 3.1 per 100 > 2
    assert checks["Stability"]["status"] == "fail"
    assert "1 timeouts + 0 OOMs in 32 requests = 3.12 per 100" in checks["Stability"]["evidence"]
    tput = built["report"]["overall"]["throughput"]
    tokens_per_s = tput["input_tokens_per_s"] + tput["output_tokens_per_s"]
    per_1k = 2.5 / (tokens_per_s * 3600 / 1000)
    assert checks["Cost"]["status"] == "pass"
    assert f"${per_1k:.4f} per 1K tokens" in checks["Cost"]["evidence"]
    assert checks["Observability"]["status"] == "pass"
    assert checks["Security"]["status"] == "not measurable here"
    assert checks["Admission control"]["status"] == "pass"
    assert "served without rejection or error: b" in checks["Admission control"]["evidence"]
    for item in checks:
        assert item in built["html"] and item in built["md"]
    assert not math.isnan(per_1k)


def test_a_bare_seed_run_marks_every_criterion_it_cannot_fill(tmp_path: Path) -> None:
    db = tmp_path / "s.duckdb"
    Store(db).add_events([{"request_id": "run-bare-1", "ttft_ms": 5, "status": "ok"}])
    out = tmp_path / "r"
    servescope("report", "build", "run-bare", "--store", str(db), "--out", str(out), check=True)
    checks = {c["item"]: c for c in json.loads((out / "run-bare/report.json").read_text())[
        "checklist"]}  # fmt: skip
    for item in ("Model loading", "API compatibility", "Cost", "Admission control"):
        assert checks[item]["status"] == "not measured", item
    assert checks["Observability"]["status"] == "fail"  # no model, no tokens on the event


def test_chat_calls_are_known_as_the_collector_stores_them(tmp_path: Path) -> None:
    """What the collector writes for an OpenAI SDK's chat calls to a vLLM it follows: the event's
    id is the one inside vLLM's (`chatcmpl-R` → R, `vllm_request_id` keeps vLLM's), and a call
    vLLM refused is its access line (`http_path`). They are chat calls, not "no chat requests"."""
    run = "vllm-tiny-8000-20261124T230000Z"
    common = {"run_id": run, "model": "tiny", "source": "vllm-log", "vllm_session": run}
    docs = [
        {**common, "request_id": f"b8c4d1c368f6b67{i}", "vllm_request_id":
         f"chatcmpl-b8c4d1c368f6b67{i}", "prompt_tokens": 12, "completion_tokens": 8,
         "server_e2e_ms": 30.0, "status": "ok"} for i in range(3)
    ] + [
        {**common, "request_id": "http-e4b75ba9-68216", "status": "error", "http_status": 400,
         "error": "http_4xx", "http_method": "POST", "http_path": "/v1/chat/completions"},
        {**common, "request_id": "a1b2c3d4e5f60718", "vllm_request_id": "cmpl-a1b2c3d4e5f60718-0",
         "prompt_tokens": 12, "completion_tokens": 8, "server_e2e_ms": 20.0, "status": "ok"},
    ]  # fmt: skip
    db = tmp_path / "s.duckdb"
    Store(db).add_events(docs)
    out = tmp_path / "r"
    servescope("report", "build", run, "--store", str(db), "--out", str(out), "--format", "json",
               check=True)  # fmt: skip
    report = json.loads(next(out.glob("*/report.json")).read_text())
    checks = {c["item"]: c for c in report["checklist"]}
    assert checks["API compatibility"]["status"] == "pass", checks["API compatibility"]
    assert "3 of 4 chat calls succeeded" in checks["API compatibility"]["evidence"]


def test_a_server_sessions_chat_calls_pass_on_vllms_own_records(tmp_path: Path) -> None:
    """A session run (an OpenAI client, no X-Request-Id, no workload spec): chat calls are known
    by vLLM's `chatcmpl-` ids and the latency is vLLM's own (`server_e2e_ms`)."""
    run = "vllm-tiny-8000-20261124T230000Z"
    common = {"run_id": run, "model": "tiny", "prompt_tokens": 12, "completion_tokens": 8}
    docs = [
        {**common, "request_id": "chatcmpl-a1", "server_e2e_ms": 30.0, "status": "ok"},
        {**common, "request_id": "chatcmpl-a2", "server_e2e_ms": 31.0, "status": "ok"},
        {**common, "request_id": "chatcmpl-a3", "status": "error", "error": "http_4xx"},
        {**common, "request_id": "cmpl-b1", "server_e2e_ms": 20.0, "status": "ok"},
    ]
    db = tmp_path / "s.duckdb"
    Store(db).add_events(docs)
    out = tmp_path / "r"
    servescope("report", "build", run, "--store", str(db), "--out", str(out), check=True)
    report = json.loads(next(out.glob("*/report.json")).read_text())
    checks = {c["item"]: c for c in report["checklist"]}
    assert checks["API compatibility"]["status"] == "pass"
    assert "2 of 3 chat calls succeeded" in checks["API compatibility"]["evidence"]
    assert checks["Observability"]["status"] == "pass", checks["Observability"]["evidence"]
