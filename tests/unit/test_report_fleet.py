"""Reports of a fleet run (reports/replicas.py): the per-replica table, the skew lines, the
per-replica change of a diff and the diagnosis's routing rules — each checked against a plain
computation over the stored events and samples. The same reports over real replicas behind
the gateway are built by tests/e2e/test_fleet_vllm.py and the `routing` experiment."""

from __future__ import annotations

import math
import statistics
from datetime import timedelta
from pathlib import Path

from servescope.reports import build_diff, build_summary
from servescope.reports.histograms import histogram_quantile
from servescope.store import Store
from tests.helpers.fleet import LES, T0, URLS, fleet_run
from tests.helpers.stats import percentile


def test_histogram_quantile_is_prometheus() -> None:
    buckets = [(0.1, 2.0), (0.5, 6.0), (1.0, 8.0), (math.inf, 10.0)]
    # rank 5 falls in (0.1, 0.5]: 0.1 + 0.4 × (5 − 2) / (6 − 2)
    assert histogram_quantile(0.5, buckets) == 0.1 + 0.4 * 3 / 4
    assert histogram_quantile(0.95, buckets) == 1.0  # in the +Inf bucket: the highest bound
    assert histogram_quantile(0.1, buckets) == 0.1 * 1 / 2  # first bucket starts at 0
    assert histogram_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]) is None
    assert histogram_quantile(0.5, [(1.0, 3.0)]) is None  # no +Inf bucket


def test_a_fleet_run_gets_a_table_per_replica_and_skew_lines(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    events = fleet_run(store, "run-fleet-a", share_r1=30, start=T0, policy="round-robin",
                       hits={"r1": (4000.0, 5000.0), "r2": (500.0, 5000.0)})  # fmt: skip
    report = build_summary(store, "run-fleet-a")
    rows = {r["replica"]: r for r in report["replicas"]}
    assert set(rows) == {"r1", "r2", None}  # every request accounted for
    assert sum(r["requests"] for r in rows.values()) == 40
    for name in ("r1", "r2"):
        mine = [e for e in events if e.get("upstream") == name]
        ok = [e["ttft_ms"] for e in mine if e["status"] == "ok"]
        row = rows[name]
        assert row["requests"] == len(mine) and row["url"] == URLS[name]
        assert row["errors"] == sum(e["status"] != "ok" for e in mine)
        assert math.isclose(row["ttft_ms_p50"], percentile(ok, 0.5))
        assert math.isclose(row["ttft_ms_p95"], percentile(ok, 0.95))
    assert rows["r2"]["errors_by_class"] == {"disconnect": 1}
    assert rows[None]["errors_by_class"] == {"connect": 1}
    assert rows["r1"]["route_reasons"] == {"round-robin": 30}
    assert rows["r1"]["prefix_cache_hit_ratio"] == 0.8
    assert rows["r2"]["prefix_cache_hit_ratio"] == 0.1
    assert rows["r1"]["kv_cache_usage_peak"] == 0.5 and rows["r2"]["kv_cache_usage_peak"] == 0.2
    assert rows["r1"]["preemptions"] == 0 and rows["r2"]["preemptions"] == 1
    assert rows["r1"]["server_requests_finished"] == 30
    # queue p95 from each replica's bucket growth, as Prometheus computes it
    r1_buckets = [(float(le), float(c)) for le, c in zip(LES, [1, 3, 6, 9, 10, 10], strict=True)]
    assert math.isclose(rows["r1"]["queue_ms_p95"], histogram_quantile(0.95, r1_buckets) * 1000)
    skew = report["skew"]
    loads = [30, 9]  # r2: requests 30-38 (39 reached no replica)
    assert math.isclose(skew["requests"]["max_over_mean"], 30 / statistics.mean(loads))
    assert math.isclose(skew["requests"]["cv"], statistics.pstdev(loads) / statistics.mean(loads))
    ratios = [0.8, 0.1]
    assert math.isclose(
        skew["prefix_cache_hit_ratio"]["cv"], statistics.pstdev(ratios) / statistics.mean(ratios)
    )
    assert skew["preemptions"]["max_over_mean"] == 2.0
    # the diagnosis reads the skew: both fleet rules, with the numbers
    found = {f["rule"]: f for f in report["diagnosis"]["findings"]}
    assert {"fleet-load-skew", "fleet-hit-skew"} <= set(found)
    assert found["fleet-load-skew"]["levers"][0]["lever"] == "routing"
    assert any("1.5×" in line for line in found["fleet-load-skew"]["evidence"])
    assert any("10.0 % → 80.0 %" in line for line in found["fleet-hit-skew"]["evidence"])


def test_a_run_of_one_server_has_no_replica_table_and_no_fleet_findings(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    store.add_events([{"request_id": f"run-one-{i:06d}", "ttft_ms": 10.0 + i, "status": "ok",
                       "ts": (T0 + timedelta(seconds=i)).isoformat() + "Z"}
                      for i in range(10)])  # fmt: skip
    report = build_summary(store, "run-one")
    assert report["replicas"] is None and report["skew"] is None
    diagnosis = report["diagnosis"]
    assert not [u for u in diagnosis["not_judged"] if u["rule"].startswith("fleet")]
    assert diagnosis["indicators"]["replicas"]["value"] == 1


def test_a_diff_of_two_fleet_runs_shows_the_change_per_replica(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    fleet_run(store, "run-fleet-rr", share_r1=19, start=T0, policy="round-robin",
              hits={"r1": (1000.0, 5000.0), "r2": (1000.0, 5000.0)})  # fmt: skip
    fleet_run(store, "run-fleet-pa", share_r1=21, start=T0 + timedelta(minutes=5),
              policy="prefix-affinity",
              hits={"r1": (4000.0, 5000.0), "r2": (3800.0, 5000.0)})  # fmt: skip
    report = build_diff(store, "run-fleet-pa", "run-fleet-rr")
    assert report["before"]["replicas"] and report["after"]["replicas"]
    changes = {r["replica"]: r for r in report["replicas_diff"]}
    assert changes["r1"]["requests"] == {"before": 19, "after": 21, "delta": 2}
    hit = changes["r2"]["prefix_cache_hit_ratio"]
    assert math.isclose(hit["before"], 0.2) and math.isclose(hit["after"], 0.76)
    # the fleet's own hit ratio (counters summed over both replicas) is a diff row
    rows = {d["metric"]: d for d in report["diff"]}
    fleet_hit = rows["server.prefix_cache_hit_ratio"]
    assert math.isclose(fleet_hit["before"], 0.2) and math.isclose(fleet_hit["after"], 0.78)
    # round-robin left the shared prefix uncached: the routing flip was meant for that
    assert report["diagnosis"]["before_first"] is not None
    flip = {f["lever"]: f for f in report["diagnosis"]["flip"]}["routing"]
    assert flip["rule"] == "fleet-prefix-scattered" and flip["verdict"] == "resolved"
