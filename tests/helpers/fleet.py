"""A fleet run for the report tests: two replicas behind the gateway, a chosen share of requests on
each, failures on one, and each replica's prefix-cache counters scraped."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from servescope.store import Store

T0 = datetime(2026, 11, 25, 9, 0, 0)
URLS = {"r1": "http://127.0.0.1:8011", "r2": "http://127.0.0.1:8012"}
SPEC = {"workloads": [{"name": "t", "prefix_tokens": 1000, "input_tokens": 100,
                       "output_tokens": 8, "concurrency": [4], "endpoint": "chat"}]}  # fmt: skip
# queue-time buckets (s): the upper bounds vLLM's histogram has around these values
LES = ("0.01", "0.05", "0.1", "0.5", "1.0", "+Inf")


def fleet_run(store: Store, run_id: str, *, share_r1: int, hits: dict[str, tuple[float, float]],
              start: datetime, policy: str) -> list[dict[str, Any]]:  # fmt: skip
    """40 requests, `share_r1` of them on r1, two failed on r2 (one before any replica), and two
    scrapes of each replica with the given (hits, queries) growth."""
    events = []
    for i in range(40):
        replica = "r1" if i < share_r1 else "r2"
        event: dict[str, Any] = {
            "request_id": f"{run_id}-{i + 1:06d}",
            "ts": (start + timedelta(milliseconds=100 * i)).isoformat() + "Z",
            "model": "tiny",
            "source": "client",
            "prompt_tokens": 1100,
            "completion_tokens": 8,
            "ttft_ms": (30.0 if replica == "r1" else 90.0) + i,
            "tpot_ms": 5.0,
            "e2e_ms": 200.0,
            "status": "ok",
            "upstream": replica,
            "route_reason": "prefix-home" if policy == "prefix-affinity" else "round-robin",
            "workload": "t",
            "concurrency": 4,
        }
        if i in (38, 39):
            event.update(status="error", error="disconnect", ttft_ms=None)
        if i == 39:
            del event["upstream"], event["route_reason"]
            event["error"] = "connect"
        events.append({k: v for k, v in event.items() if v is not None})
    store.add_events(events)
    notes = {"replicas": URLS}
    store.upsert_run(run_id, model="tiny", levers={"enable_prefix_caching": True,
                     "routing": policy}, workload=SPEC, notes=notes)  # fmt: skip
    rows = []
    for name, (hit, query) in hits.items():
        url = URLS[name]
        for k, ts in enumerate((start - timedelta(seconds=1), start + timedelta(seconds=10))):
            grow = k  # the first scrape is the baseline
            rows += [
                (ts, url, "vllm:prefix_cache_hits_total", {}, run_id, 1000 + grow * hit),
                (ts, url, "vllm:prefix_cache_queries_total", {}, run_id, 5000 + grow * query),
                (ts, url, "vllm:num_preemptions_total", {}, run_id, 2 + grow * (name == "r2")),
                (ts, url, "vllm:request_success_total", {"finished_reason": "length"}, run_id,
                 100 + grow * (share_r1 if name == "r1" else 38 - share_r1)),
                (ts, url, "vllm:kv_cache_usage_perc", {}, run_id,
                 0.2 + 0.3 * grow * (name == "r1")),
            ]  # fmt: skip
            cumulative = [1, 3, 6, 9, 10, 10] if name == "r1" else [0, 1, 2, 4, 8, 10]
            rows += [(ts, url, "vllm:request_queue_time_seconds_bucket", {"le": le}, run_id,
                      50 + grow * c) for le, c in zip(LES, cumulative, strict=True)]  # fmt: skip
    store.add_metric_samples(rows)
    return events
