"""`report build RUN --vs BASE` / `--split-at-flip` on synthetic stored runs with a known effect.

Every expected number is recomputed here in plain Python from the events (percentiles, Δ, and
a plain resampling bootstrap for the verdicts), never read back from the code under test.
"""

from __future__ import annotations

import json
import random
import re
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from servescope.reports import bootstrap
from servescope.store import Store
from tests.helpers.cli import servescope
from tests.helpers.markdown import markdown_text
from tests.helpers.reports import SPEC, T0, store_run, synthetic_events
from tests.helpers.stats import percentile


def counter(store: Store, run_id: str, name: str, start: datetime, first: float, last: float):
    store.add_metric_samples(
        [
            (start, "vllm", name, {"model_name": "tiny"}, run_id, first),
            (start + timedelta(seconds=10), "vllm", name, {"model_name": "tiny"}, run_id, last),
        ]
    )


LEVELS = {"short-short · concurrency 4": 4, "short-short · concurrency 8": 8}


def rows_at(report: dict[str, Any], level: str) -> dict[str, dict[str, Any]]:
    """The diff's rows of one load level, and of the whole run, by metric."""
    found = {d["metric"]: d for d in report["diff"] if d["level"] == "whole run"}
    found.update({d["metric"]: d for d in report["diff"] if d["level"] == level})
    return found


def plain_bootstrap_verdict(
    before: list[float], after: list[float], q: float, better: str = "lower", level: float = 0.95
) -> tuple[str, tuple[float, float]]:
    """Resample each side with replacement 2000 times; the interval of Δ at `level` decides."""
    rng = random.Random(7)
    deltas = sorted(
        percentile(rng.choices(after, k=len(after)), q)
        - percentile(rng.choices(before, k=len(before)), q)
        for _ in range(2000)
    )
    cut = round((1 - level) / 2 * 2000)
    lo, hi = deltas[cut], deltas[min(1999 - cut, 1999)]
    if lo <= 0 <= hi:
        return "unchanged", (lo, hi)
    return ("improved" if (hi < 0) == (better == "lower") else "regressed"), (lo, hi)


@pytest.fixture(scope="module")
def ab(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("ab")
    db = folder / "s.duckdb"
    store = Store(db)
    start_b = T0 + timedelta(minutes=1)
    before = synthetic_events("run-20261122-off", seed=1, ttft_divisor=1, start=T0)
    after = synthetic_events("run-20261122-on", seed=2, ttft_divisor=5, start=start_b)
    store_run(store, "run-20261122-off", before, levers={"enable_prefix_caching": False})
    store_run(store, "run-20261122-on", after, levers={"enable_prefix_caching": True})
    counter(store, "run-20261122-off", "vllm:prefix_cache_hits_total", T0, 0, 0)
    counter(store, "run-20261122-off", "vllm:prefix_cache_queries_total", T0, 0, 10000)
    counter(store, "run-20261122-on", "vllm:prefix_cache_hits_total", start_b, 100, 9400)
    counter(store, "run-20261122-on", "vllm:prefix_cache_queries_total", start_b, 10000, 20000)
    store.add_lever_flip(
        "enable_prefix_caching",
        "false",
        "true",
        run_id="run-20261122-on",
        ts=start_b - timedelta(seconds=1),
    )
    out = folder / "reports"
    done = servescope(
        "report",
        "build",
        "run-20261122-on",
        "--vs",
        "run-20261122-off",
        "--store",
        str(db),
        "--out",
        str(out),
        check=True,
    )
    folder_name = out / "run-20261122-on-vs-run-20261122-off"
    return {
        "db": db,
        "out": out,
        "stdout": done.stdout,
        "stderr": done.stderr,
        "report": json.loads((folder_name / "report.json").read_text()),
        "html": (folder_name / "index.html").read_text(),
        "md": (folder_name / "report.md").read_text(),
        "before": before,
        "after": after,
    }


def test_known_effect_is_improved_and_known_non_effect_is_unchanged(ab: dict[str, Any]) -> None:
    """Each load level against its counterpart (one run a side: request noise only)."""
    expected = {"ttft_ms": "improved", "tpot_ms": "unchanged"}
    for (level, concurrency), (metric, verdict) in (
        (lv, m) for lv in LEVELS.items() for m in expected.items()
    ):
        rows = rows_at(ab["report"], level)
        b = [e[metric] for e in ab["before"] if e["concurrency"] == concurrency]
        a = [e[metric] for e in ab["after"] if e["concurrency"] == concurrency]
        for name, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99)):
            row = rows[f"{metric}.{name}"]
            assert row["before"] == pytest.approx(percentile(b, q), rel=1e-9)
            assert row["after"] == pytest.approx(percentile(a, q), rel=1e-9)
            delta = percentile(a, q) - percentile(b, q)
            assert row["delta"] == pytest.approx(delta, rel=1e-9)
            assert row["delta_pct"] == pytest.approx(delta / percentile(b, q) * 100, rel=1e-9)
            if name == "p99":  # 200 requests a level: 2 beyond the p99
                assert row["verdict"] == "too few samples" and row["ci95"] is None
                assert row["too_few"] == "200 requests; p99 needs 300"
                continue
            # the interval is read at the level its verdict was reached at (Holm's step)
            plain, (lo, hi) = plain_bootstrap_verdict(b, a, q, level=row["confidence"])
            assert row["test"]["covers"] == "request noise only"
            assert row["verdict"] == plain == verdict, (metric, name, row, lo, hi)
            # the interval itself agrees with plain resampling (up to Monte Carlo noise)
            width = hi - lo
            assert abs(row["ci95"][0] - lo) < 0.25 * width, (metric, name, row["ci95"], lo, hi)
            assert abs(row["ci95"][1] - hi) < 0.25 * width, (metric, name, row["ci95"], lo, hi)


def test_diff_rows_have_the_contract_shape(ab: dict[str, Any]) -> None:
    report = ab["report"]
    for key in ("run_id", "levers", "overall", "groups"):
        assert key in report
    assert report["run_id"] == "run-20261122-on"
    assert set(report["overall"]["ttft_ms"]) >= {"p50", "p95", "p99", "mean"}
    assert {d["level"] for d in report["diff"]} == {*LEVELS, "all levels (stratified)", "whole run"}
    rows = rows_at(report, "short-short · concurrency 8")
    required = [
        "ttft_ms.p50",
        "ttft_ms.p95",
        "ttft_ms.p99",
        "tpot_ms.p50",
        "tpot_ms.p95",
        "e2e_ms.p95",
        "queue_ms.p95",
        "error_rate",
        "throughput.output_tokens_per_s",
        "cache_hit_request_ratio",
    ]
    for metric in required:
        assert {"metric", "level", "before", "after", "delta", "delta_pct", "ci95", "verdict",
                "p_value", "role", "detectable_pct", "repeats"} <= set(rows[metric])  # fmt: skip
    assert report["repeats"]["before"] == report["repeats"]["after"] == 1
    assert report["repeats"]["covers"] == "request noise only"
    assert report["primary"]["metric"] == "ttft_ms.p50"  # prefix caching targets prefill
    assert [d["role"] for d in report["diff"]].count("primary") == 1
    # not measured on either side: null and said so, never 0
    assert rows["queue_ms.p95"]["before"] is None and rows["queue_ms.p95"]["ci95"] is None
    assert rows["queue_ms.p95"]["verdict"] == "not measured"
    assert rows["cache_hit_request_ratio"]["verdict"] == "not measured"
    assert rows["error_rate"]["before"] == 0 and rows["error_rate"]["verdict"] == "unchanged"
    level = [e for e in ab["after"] if e["concurrency"] == 8]
    e2e = [e["e2e_ms"] for e in level]
    assert rows["e2e_ms.p95"]["after"] == pytest.approx(percentile(e2e, 0.95), rel=1e-9)
    # throughput at a level: its successful requests' tokens ÷ (its last end − its first start)
    first = datetime.fromisoformat(level[0]["ts"].rstrip("Z"))
    end = max(
        datetime.fromisoformat(e["ts"].rstrip("Z")) + timedelta(milliseconds=e["e2e_ms"])
        for e in level
    )
    tokens = sum(e["completion_tokens"] for e in level)
    assert rows["throughput.output_tokens_per_s"]["after"] == pytest.approx(
        tokens / (end - first).total_seconds(), rel=1e-4
    )
    server = rows["server.prefix_cache_hit_ratio"]
    assert server["level"] == "whole run"  # counters are not per level
    assert server["before"] == 0 and server["after"] == pytest.approx(0.93)


def test_headline_and_lever_changes(ab: dict[str, Any]) -> None:
    report = ab["report"]
    rows = rows_at(report, "all levels (stratified)")  # the level the report leads with
    assert report["primary"]["level"] == "all levels (stratified)"
    ttft = rows["ttft_ms.p50"]
    headline = report["headline"]
    assert headline.startswith(
        "enable_prefix_caching off → on (one run a side: request noise only): TTFT p50 over all "
        "load levels (stratified) improved: −"
    ), headline
    assert f"−{abs(ttft['delta_pct']):.0f} %" in headline
    assert "prefix hit ratio 0 % → 93 %" in headline
    tput = rows["throughput.output_tokens_per_s"]
    # one run a side, a level of several: its rate has no windows of its own to resample
    assert tput["ci95_pct"] is None and tput["verdict"] == "not tested"
    assert f"throughput {'+' if tput['delta_pct'] > 0 else '−'}" in headline
    assert report["lever_changes"] == [
        {"lever": "enable_prefix_caching", "before": False, "after": True}
    ]
    assert report["warnings"] == []
    assert headline in ab["html"] and headline in markdown_text(ab["md"])
    assert "enable_prefix_caching" in ab["stderr"]  # the headline, printed for the terminal


def test_the_report_is_reproducible(ab: dict[str, Any], tmp_path: Path) -> None:
    servescope(
        "report",
        "build",
        "run-20261122-on",
        "--vs",
        "run-20261122-off",
        "--store",
        str(ab["db"]),
        "--out",
        str(tmp_path),
        "--format",
        "json",
        check=True,
    )
    again = json.loads((tmp_path / "run-20261122-on-vs-run-20261122-off/report.json").read_text())
    assert again["diff"] == ab["report"]["diff"]


def test_pictures_are_inline_svg_with_the_flip_marked(ab: dict[str, Any]) -> None:
    html = ab["html"]
    for title in (
        "TTFT: cumulative distribution",
        "TTFT over time",
        "TTFT p95 vs concurrency",
        "Output throughput vs concurrency",
    ):
        assert f"<title>{title}</title>" in html
    assert html.count("<svg") >= 5
    assert "enable_prefix_caching: false → true" in html  # the flip marker's label
    # the minute between the two runs is folded, not drawn as empty space
    assert "between the runs not drawn" in html


def test_the_idle_gap_between_runs_is_folded_and_time_stays_monotonic() -> None:
    from servescope.reports.charts import Timeline

    clock = Timeline([(100.0, 120.0), (400.0, 420.0)])  # each side's first and last start
    assert clock.x(100.0) == 0.0 and clock.x(120.0) == 20.0
    assert clock.x(400.0) == pytest.approx(20.0 + clock.pad)  # drawn gap: 5 % of 40 s, ≥ 1 s
    assert clock.folded == pytest.approx(280.0 - clock.pad)
    grid = np.linspace(90.0, 430.0, 500)
    assert np.all(np.diff(clock.xs(grid)) >= 0)  # a flip inside the gap lands inside it
    assert clock.label == "seconds of measurement (278 s between the runs not drawn)"
    one_run = Timeline([(0.0, 12.0)])
    assert one_run.label == "seconds since the first request"


def test_split_at_flip_compares_the_two_parts_of_one_run(tmp_path: Path) -> None:
    db = tmp_path / "s.duckdb"
    store = Store(db)
    run_id = "run-20261122-flip"
    slow = synthetic_events(run_id, seed=3, ttft_divisor=1, start=T0, n=200)
    fast = synthetic_events(run_id, seed=4, ttft_divisor=5, start=T0 + timedelta(seconds=30), n=200)
    for i, event in enumerate(fast):
        event["request_id"] = f"{run_id}-{i + 201:06d}"
    store_run(store, run_id, slow + fast, levers={"enable_prefix_caching": True})
    store.add_lever_flip(
        "enable_prefix_caching", "false", "true", run_id=run_id, ts=T0 + timedelta(seconds=25)
    )
    out = tmp_path / "r"
    servescope(
        "report", "build", run_id, "--split-at-flip", "--store", str(db), "--out", str(out),
        check=True,
    )  # fmt: skip
    report = json.loads((out / f"{run_id}-at-flip" / "report.json").read_text())
    assert report["overall"]["requests"] == 400  # the skeleton keys describe the whole run
    assert report["before"]["overall"]["requests"] == 200
    assert report["after"]["overall"]["requests"] == 200
    rows = rows_at(report, "short-short · concurrency 8")
    b = [e["ttft_ms"] for e in slow if e["concurrency"] == 8]
    a = [e["ttft_ms"] for e in fast if e["concurrency"] == 8]
    assert rows["ttft_ms.p95"]["before"] == pytest.approx(percentile(b, 0.95), rel=1e-9)
    assert rows["ttft_ms.p95"]["after"] == pytest.approx(percentile(a, 0.95), rel=1e-9)
    assert rows["ttft_ms.p95"]["verdict"] == "improved"
    assert rows["tpot_ms.p50"]["verdict"] == "unchanged"
    assert report["headline"].startswith(
        "enable_prefix_caching false → true (one run a side: request noise only): TTFT p50 over "
        "all load levels (stratified) improved: −"
    ), report["headline"]

    no_flip = "run-20261122-noflip"
    store_run(store, no_flip, synthetic_events(no_flip, seed=5, ttft_divisor=1, start=T0),
              levers={})  # fmt: skip
    result = servescope("report", "build", no_flip, "--split-at-flip", "--store", str(db))
    assert result.returncode == 2 and "no lever_flips row" in result.stderr


def test_different_workloads_warn(tmp_path: Path) -> None:
    db = tmp_path / "s.duckdb"
    store = Store(db)
    base = synthetic_events("run-base", seed=1, ttft_divisor=1, start=T0)
    other = synthetic_events("run-other", seed=2, ttft_divisor=1, start=T0, n=300)
    for event in other:
        event["prompt_tokens"] = 2048
    other_spec = json.loads(json.dumps(SPEC))
    other_spec["workloads"][0].update(input_tokens=2048, seed=9, requests_per_level=150)
    store_run(store, "run-base", base, levers={"max_num_seqs": 8})
    store_run(store, "run-other", other, levers={"max_num_seqs": 16}, spec=other_spec)
    out = tmp_path / "r"
    result = servescope(
        "report", "build", "run-other", "--vs", "run-base", "--store", str(db), "--out", str(out),
        "--format", "json", check=True,
    )  # fmt: skip
    report = json.loads((out / "run-other-vs-run-base" / "report.json").read_text())
    warnings = " | ".join(report["warnings"])
    assert "the workloads differ" in warnings
    assert "input_tokens: 512 vs 2048" in warnings and "seed: 0 vs 9" in warnings
    assert "request counts differ (200 vs 150)" in warnings
    assert "prompt sizes differ" in warnings
    assert "the workloads differ" in result.stderr


def test_a_run_without_events_is_reported_not_compared(tmp_path: Path) -> None:
    db = tmp_path / "s.duckdb"
    store = Store(db)
    store_run(store, "run-full", synthetic_events("run-full", seed=1, ttft_divisor=1, start=T0),
              levers={})  # fmt: skip
    store.upsert_run("run-empty", model="tiny")
    out = tmp_path / "r"
    servescope(
        "report", "build", "run-empty", "--vs", "run-full", "--store", str(db), "--out", str(out),
        check=True,
    )  # fmt: skip
    folder = out / "run-empty-vs-run-full"
    report = json.loads((folder / "report.json").read_text())
    assert "run-empty has no events" in report["headline"]
    assert {d["verdict"] for d in report["diff"] if d["metric"].startswith("ttft")} == {
        "not measured"
    }
    assert report["overall"]["requests"] == 0
    assert "has no events" in (folder / "report.md").read_text()


def test_unknown_runs_exit_2_naming_the_known_ones(tmp_path: Path) -> None:
    db = tmp_path / "s.duckdb"
    Store(db).add_events([{"request_id": "run-known-1"}])
    for args in (("run-known", "--vs", "run-nope"), ("run-nope", "--vs", "run-known")):
        result = servescope("report", "build", *args, "--store", str(db))
        assert result.returncode == 2
        assert "run-nope" in result.stderr and "known runs: run-known" in result.stderr


def test_report_list_shows_levers_and_event_counts(tmp_path: Path) -> None:
    db = tmp_path / "s.duckdb"
    store = Store(db)
    events = synthetic_events("run-l", seed=1, ttft_divisor=1, start=T0, n=10)
    events[0].update(status="rejected", error="rejected:queue_full", team="a")
    events[1].update(status="error", error="http_5xx")
    store_run(store, "run-l", events, levers={"enable_prefix_caching": True})
    store.add_lever_flip("enable_prefix_caching", "false", "true", run_id="run-l", ts=T0)
    listed = json.loads(servescope("report", "list", "--store", str(db), "--json").stdout)
    assert [
        (r["run_id"], r["events"], r["ok"], r["errors"], r["rejected"], r["flips"], r["levers"])
        for r in listed
    ] == [("run-l", 10, 8, 1, 1, 1, {"enable_prefix_caching": True})]
    table = servescope("report", "list", "--store", str(db), check=True).stdout
    # levers in their JSON spelling, as flips and vLLM's flags write them
    assert "run-l" in table and "enable_prefix_caching=true" in table


def test_bootstrap_draws_match_plain_resampling() -> None:
    """The exact quantile bootstrap has the distribution of brute-force resampling."""
    rng = np.random.default_rng(3)
    values = np.sort(rng.lognormal(3.0, 1.0, 150))
    ours = bootstrap.quantile_draws(values, 0.95, draws=20000)(np.random.default_rng(0))
    brute = np.array([np.quantile(rng.choice(values, len(values)), 0.95) for _ in range(20000)])
    for q in (5, 25, 50, 75, 95):
        assert np.percentile(ours, q) == pytest.approx(np.percentile(brute, q), rel=0.03)


def test_tail_quantiles_of_small_runs_say_too_few_samples(tmp_path: Path) -> None:
    """20 requests a side: a p95 or p99 interval would be the bootstrap guessing beyond the
    sample (two warm-up outliers read as an improvement), so those rows say so instead."""
    db = tmp_path / "s.duckdb"
    store = Store(db)
    store_run(store, "run-s1", synthetic_events("run-s1", seed=1, ttft_divisor=1, start=T0, n=20),
              levers={})  # fmt: skip
    store_run(store, "run-s2", synthetic_events("run-s2", seed=2, ttft_divisor=5, start=T0, n=20),
              levers={})  # fmt: skip
    out = tmp_path / "r"
    servescope(
        "report", "build", "run-s2", "--vs", "run-s1", "--store", str(db), "--out", str(out),
        "--format", "json", check=True,
    )  # fmt: skip
    rows = {d["metric"]: d for d in json.loads((out / "run-s2-vs-run-s1/report.json").read_text())[
        "diff"]}  # fmt: skip
    assert rows["ttft_ms.p50"]["verdict"] == "improved"  # 10 requests beyond the median
    for metric in ("ttft_ms.p95", "ttft_ms.p99", "tpot_ms.p95", "e2e_ms.p99"):
        assert rows[metric]["verdict"] == "too few samples", metric
        assert rows[metric]["ci95"] is None  # no interval could be formed: none is shown
        assert rows[metric]["too_few"].startswith("10 requests; "), rows[metric]  # a level
    headline = json.loads((out / "run-s2-vs-run-s1/report.json").read_text())["headline"]
    assert ": TTFT p50 over all load levels (stratified) improved: −" in headline  # it leads


def test_runs_read_from_a_log_alone_get_a_headline_of_what_they_have(tmp_path: Path) -> None:
    """`collect --once` on a log gives requests with a status and a time but no latency or token
    count: the headline compares the request rate, never says nothing was measured."""
    db = tmp_path / "s.duckdb"
    store = Store(db)
    for run, n, start in (("run-log-a", 20, T0), ("run-log-b", 60, T0 + timedelta(minutes=5))):
        events = [{"request_id": f"{run}-{i}", "run_id": run, "model": "tiny", "status": "ok",
                   "ts": (start + timedelta(milliseconds=500 * i)).isoformat() + "Z"}
                  for i in range(n)]  # fmt: skip
        store_run(store, run, events, levers={"max_num_seqs": 2 if n == 20 else 16}, spec=None)
    out = tmp_path / "r"
    servescope("report", "build", "run-log-b", "--vs", "run-log-a", "--store", str(db),
               "--out", str(out), "--format", "json", check=True)  # fmt: skip
    report = json.loads((out / "run-log-b-vs-run-log-a/report.json").read_text())
    rows = {d["metric"]: d for d in report["diff"]}
    assert rows["throughput.requests_per_s"]["before"] is not None
    assert "no indicator measured" not in report["headline"], report["headline"]
    assert report["headline"].startswith(
        "max_num_seqs 2 → 16 (one run a side: request noise only; (no workload)): requests/s "
    ), report["headline"]
    # raising max_num_seqs targets the queue; neither queue time nor TTFT was measured
    assert report["primary"]["asked"] == "queue_ms.p50"
    # one level: the whole run's windows give its rate an interval, said in the headline
    rate = rows["throughput.requests_per_s"]
    low, high = (f"{abs(v):.0f} %" for v in rate["ci95_pct"])
    assert re.search(
        rf"requests/s [+−±]\d+ % \([+−±]{low[:-2]} … [+−±]{high}\) \[{rate['verdict']}\]",
        report["headline"],
    ), report["headline"]


def test_speculation_headline_names_a_workload_whose_tpot_was_zero_before() -> None:
    """On 2 shared cores a fast server can send a whole answer in one chunk (client TPOT 0):
    no percentage from 0, so the change is given in ms, and the workload is still named."""
    from servescope.reports.specdecode import headline_part

    def workload(name: str, before: float, after: float, accept: float) -> dict[str, Any]:
        change = (after - before) / before * 100 if before else None
        return {"workload": name, "tpot_ms_p50_before": before, "tpot_ms_p50_after": after,
                "tpot_ms_p50_change_pct": change, "tpot_verdict": "regressed",
                "acceptance_after": accept}  # fmt: skip

    section = {
        "on_before": False, "on_after": True, "acceptance_before": None,
        "acceptance_after": 0.21,
        "workloads": [workload("repeat", 0.0, 2.14, 1.0), workload("decoy", 1.0, 4.51, 0.0)],
    }  # fmt: skip
    rows = [{"metric": "tpot_ms.p50", "before": 0.0, "after": 2.14, "delta_pct": None,
             "verdict": "regressed"}]  # fmt: skip
    assert headline_part(section, rows) == (
        "TPOT p50 0.00 → 2.14 ms [regressed], "
        "repeat: TPOT p50 0.00 → 2.14 ms [regressed] at 100 % acceptance, "
        "decoy: TPOT p50 +351 % [regressed] at 0 % acceptance, "
        "draft acceptance off → 21 %"
    )


def test_streams_in_one_chunk_carry_no_client_tpot(tmp_path: Path) -> None:
    """A stream whose whole answer came in one chunk shows the client no decode: the client
    writes a null TPOT for it (never a 0), a report leaves such samples out of TPOT and counts
    them, and reads TPOT from vLLM's own record when more than a tenth of the streams are like
    that."""
    from servescope.wire.stream import COMPLETIONS, StreamTiming

    def chunk(text: str) -> bytes:
        return b"data: " + json.dumps({"choices": [{"text": text, "index": 0}]}).encode()

    def timed(chunks: int) -> dict[str, Any]:
        timing = StreamTiming(COMPLETIONS, start=0.0)
        for i in range(chunks):
            timing.feed_line(chunk("word " * (16 // chunks)), now=0.1 + 0.01 * i)
        usage = {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 16}}
        timing.feed_line(b"data: " + json.dumps(usage).encode(), now=0.2)
        return timing.finish({}, end=0.2)

    assert timed(1)["tpot_ms"] is None and timed(1)["itl_ms"] == []
    assert timed(4)["tpot_ms"] == pytest.approx((200 - 100) / 15)
    together = StreamTiming(COMPLETIONS, start=0.0)  # four chunks in one read: one timestamp
    for _ in range(4):
        together.feed_line(chunk("word word word word "), now=0.1)
    together.feed_line(b'data: {"choices": [], "usage": {"completion_tokens": 16}}', now=0.1)
    assert together.finish({}, end=0.1)["tpot_ms"] is None

    db = tmp_path / "s.duckdb"
    store = Store(db)
    for run, server in (("run-chunk-a", False), ("run-chunk-b", True)):
        events = synthetic_events(run, seed=9, ttft_divisor=1, start=T0, n=40)
        for i, event in enumerate(events):
            one = i % 2 == 0  # half of them at once: in one chunk, or in one read
            event.update(itl_ms=([] if i % 4 == 0 else [0.0] * 31) if one else [30.0] * 31)
            if one:  # stored by a client of before this rule: a TPOT of next to nothing
                event["tpot_ms"] = 0.01
            if server:
                event["server_tpot_ms"] = 40.0 + i % 3
        store_run(store, run, events, levers={})
    out = tmp_path / "r"
    servescope("report", "build", "run-chunk-a", "--store", str(db), "--out", str(out),
               check=True)  # fmt: skip
    report = json.loads((out / "run-chunk-a" / "report.json").read_text())
    assert report["overall"]["one_chunk_streams"] == {
        "streams": 20, "share": 0.5, "tpot_source": "client"
    }  # fmt: skip
    assert report["overall"]["tpot_ms"]["p50"] > 20  # the zeros are not averaged in
    assert "20 streams (50.0 % of those with more than one token) arrived all at once" in (
        markdown_text((out / "run-chunk-a" / "report.md").read_text())
    )
    servescope("report", "build", "run-chunk-b", "--store", str(db), "--out", str(out),
               check=True)  # fmt: skip
    traced = json.loads((out / "run-chunk-b" / "report.json").read_text())
    assert traced["overall"]["sources"]["tpot_ms"] == "server"
    assert traced["overall"]["tpot_ms"]["p50"] == pytest.approx(41.0)
