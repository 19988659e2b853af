"""The report's bounded-memory paths give exactly what holding every request gave: quantiles
equal to DuckDB's `quantile_cont` to the last digit (ITL by histogram selection, levels by
partial sorts), sorted columns kept only near the ranks read (and fetched again beyond them),
and per-window totals equal to the per-request arithmetic. Each is checked against a plain
computation over a real store: DuckDB's own aggregate, or numpy over the fetched rows."""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from servescope.reports import bootstrap, quantiles
from servescope.reports import samples as samples_module
from servescope.reports.samples import Samples, Slice, Sorted
from servescope.store import Store

T0 = datetime(2026, 11, 22, 6, 0, 0)
RUN = "run-20261122-memory"
LEVELS = [("chat", 1), ("chat", 4), ("batch", 4), (None, None)]


def events(n: int = 1500) -> list[dict[str, Any]]:
    """Heavy-tailed ITL with many repeated values, NULL gaps, errors and four levels."""
    rng = np.random.default_rng(11)
    out: list[dict[str, Any]] = []
    for i in range(n):
        workload, concurrency = LEVELS[i % len(LEVELS)]
        gaps: list[float | None] = [float(g) for g in rng.lognormal(3.0, 1.2, 5).round(1)]
        if i % 50 == 0:
            gaps.append(9_000_000.0)  # a stall: one bucket would hold almost every gap
        if i % 70 == 0:
            gaps.append(None)
        ttft = float(rng.lognormal(5.0, 0.5))
        event: dict[str, Any] = {
            "request_id": f"{RUN}-{i + 1:06d}",
            "ts": (T0 + timedelta(milliseconds=37 * i)).isoformat() + "Z",
            "model": "tiny",
            "prompt_tokens": int(rng.integers(10, 500)),
            "completion_tokens": int(rng.integers(2, 40)),
            "ttft_ms": ttft if i % 9 else 42.0,  # repeated values, like rounded timings
            "tpot_ms": float(rng.normal(30, 4)),
            "e2e_ms": ttft + 300.0 if i % 13 else None,
            "itl_ms": gaps,
            "status": "ok" if i % 17 else "error",
        }
        if workload is not None:
            event["workload"], event["concurrency"] = workload, concurrency
        out.append(event)
    return out


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("memory") / "s.duckdb"
    Store(path).add_events(events())
    return path


def _duckdb_itl(con: Any) -> tuple[Any, dict[tuple[Any, Any], Any]]:
    """What the report's ITL query was before: DuckDB's quantile aggregate over every gap."""
    gaps = """FROM (SELECT workload, concurrency, unnest(itl_ms) AS gap FROM events
                    WHERE status = 'ok' AND run_id = ?)"""
    q = "quantile_cont(gap, [0.5, 0.9, 0.95, 0.99])"
    row = con.execute("SELECT " + q + " " + gaps, [RUN]).fetchone()
    overall = row[0]
    levels = con.execute(
        "SELECT hash(workload, concurrency, NULL::DOUBLE), "
        + q
        + " "
        + gaps
        + " GROUP BY workload, concurrency",
        [RUN],
    ).fetchall()
    return overall, dict(levels)


@pytest.mark.parametrize(
    ("in_memory", "buckets", "fetch_limit"),
    [(1 << 22, 0, 0), (0, 1 << 16, 1 << 20), (0, 8, 40)],
)
def test_pooled_itl_is_duckdbs_quantile_to_the_last_digit(
    db: Path, monkeypatch: pytest.MonkeyPatch, in_memory: int, buckets: int, fetch_limit: int
) -> None:
    # past IN_MEMORY gaps, the histogram path; tiny buckets and fetches force every part of it:
    # buckets split again, fetches in batches
    monkeypatch.setattr(quantiles, "IN_MEMORY", in_memory)
    monkeypatch.setattr(quantiles, "BUCKETS", buckets)
    monkeypatch.setattr(quantiles, "FETCH_LIMIT", fetch_limit)
    with Store(db).read() as con:
        want_overall, want_levels = _duckdb_itl(con)
        counts = Samples(con, Slice(RUN)).counts
        overall, levels = quantiles.pooled_itl(
            con, Slice(RUN).params(), counts.itl_gaps, counts.level_keys
        )
    assert overall["q"] == want_overall
    assert {k: v["q"] for k, v in levels.items()} == want_levels
    assert len(levels) == len(LEVELS)


def test_pooled_itl_means_are_exact_in_memory(db: Path) -> None:
    with Store(db).read() as con:
        rows = con.execute(
            "SELECT hash(workload, concurrency, NULL::DOUBLE), list(gap) FROM (SELECT workload,"
            " concurrency, unnest(itl_ms) AS gap FROM events WHERE status = 'ok' AND run_id = ?)"
            " WHERE gap IS NOT NULL GROUP BY ALL",
            [RUN],
        ).fetchall()
        counts = Samples(con, Slice(RUN)).counts
        overall, levels = quantiles.pooled_itl(
            con, Slice(RUN).params(), counts.itl_gaps, counts.level_keys
        )

    def mean(gaps: list[float]) -> float:  # the correctly rounded mean
        return float(sum(Fraction(g) for g in gaps) / len(gaps))

    assert overall["mean"] == mean([g for _key, level in rows for g in level])
    assert {key: levels[key]["mean"] for key, _ in rows} == {key: mean(g) for key, g in rows}


@pytest.mark.parametrize("seed", range(20))
def test_exact_sum_is_the_sum_of_the_doubles_in_any_order(seed: int) -> None:
    rng = np.random.default_rng(seed)
    values = np.concatenate(
        [
            rng.lognormal(0, 12, 3000) * rng.choice([-1.0, 1.0], 3000),  # wide exponents, signs
            np.array([0.0, -0.0, 5e-324, -5e-324, 1.7976931348623157e308, -1e308, 1e-310]),
        ]
    )
    want = sum(Fraction(v) for v in values.tolist())
    got = quantiles.exact_sum(values)
    assert got == want * (1 << -quantiles._MIN_EXPONENT)
    assert quantiles.exact_sum(rng.permutation(values)) == got
    assert quantiles._mean(got, len(values)) == float(want / len(values))


def test_exact_sum_of_a_nan_or_an_infinity_is_theirs() -> None:
    assert math.isnan(quantiles.exact_sum(np.array([1.0, math.nan])))
    assert quantiles.exact_sum(np.array([1.0, math.inf])) == math.inf


def test_level_quantiles_are_duckdbs_quantile_to_the_last_digit(db: Path) -> None:
    with Store(db).read() as con:
        want = dict(
            con.execute(
                "SELECT hash(workload, concurrency, target_rate), "
                "quantile_cont(ttft_ms, [0.5, 0.9, 0.95, 0.99]) FROM events "
                "WHERE status = 'ok' AND run_id = ? GROUP BY ALL",
                [RUN],
            ).fetchall()
        )
        got = Samples(con, Slice(RUN)).level_quantiles("ttft_ms")
    assert got == want


def test_a_sorted_column_keeps_only_the_ranks_read_and_fetches_again_beyond(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(samples_module, "KEEP_ALL", 1000)
    full = np.sort(np.random.default_rng(3).lognormal(5.0, 0.6, 200_000))
    fetched = []

    def fetch() -> np.ndarray:
        fetched.append(1)
        return full

    kept = Sorted(full.copy(), fetch)
    assert sum(len(part) for _, part in kept._parts) < len(full) / 4
    assert kept.mean == float(full.mean())
    for q in (0.5, 0.9, 0.95, 0.99):
        assert bootstrap.quantile(kept, q) == bootstrap.quantile(full, q)
        a = bootstrap.quantile_draws(kept, q)
        b = bootstrap.quantile_draws(full, q)
        assert a is not None and b is not None
        draws_kept = a(np.random.default_rng(5))
        assert np.array_equal(draws_kept, b(np.random.default_rng(5)))
    assert not fetched  # every draw fell where the column was kept
    assert np.array_equal(kept[np.array([0, 7, 199_999])], full[[0, 7, 199_999]])
    assert fetched  # the ends were not kept: fetched again, exactly


def _overlaps(start: Any, end: Any, t0: float, width: float, count: int) -> Any:
    """Each span's share in each window (rows: spans; columns: windows), by brute force; a
    span shorter than a thousandth of a window is widened to that, as the report does."""
    edges = t0 + width * np.arange(count + 1)
    lo = np.clip(start, edges[0], edges[-1] - width / 1000)
    hi = np.maximum(np.clip(end, edges[0], edges[-1]), lo + width / 1000)
    inside = np.minimum(hi[:, None], edges[None, 1:]) - np.maximum(lo[:, None], edges[None, :-1])
    return np.maximum(inside, 0.0) / (hi - lo)[:, None]


def test_window_totals_spread_each_request_over_its_work(db: Path) -> None:
    slo = {"ttft_ms": 150.0, "e2e_ms": 500.0}
    with Store(db).read() as con:
        rows = con.execute(
            "SELECT epoch(ts), e2e_ms, prompt_tokens, completion_tokens, ttft_ms "
            "FROM events WHERE run_id = ? AND status = 'ok'",
            [RUN],
        ).fetchall()
        samples = Samples(con, Slice(RUN))
        width, count = 0.25, 230
        got = samples.window_totals(width, count, slo)
    assert got is not None and samples.span is not None
    t0 = samples.span[0]  # the slice's first start, a failed request's too
    t = np.array([r[0] for r in rows])
    end = t + np.array([r[1] if r[1] is not None else 0.0 for r in rows]) / 1000.0
    ttft = np.array([r[4] if r[4] is not None else 0.0 for r in rows])
    first = np.clip(t + ttft / 1000.0, t, end)
    good = np.array(
        [r[4] is not None and r[4] <= 150.0 and r[1] is not None and r[1] <= 500.0 for r in rows]
    )
    life = _overlaps(t, end, t0, width, count)
    expect = {
        "ok": life.sum(axis=0),
        "good": life[good].sum(axis=0),
        "input_tokens": np.array([r[2] or 0 for r in rows]) @ _overlaps(t, first, t0, width, count),
        "output_tokens": np.array([r[3] or 0 for r in rows])
        @ _overlaps(first, end, t0, width, count),
    }
    for name, want in expect.items():
        assert np.allclose(got[name], want, rtol=1e-9, atol=1e-6), name
        assert got[name].sum() == pytest.approx(want.sum(), rel=1e-12), name
    assert got["ok"].sum() == pytest.approx(len(rows)) and 0 < got["good"].sum() < len(rows)


def test_a_batch_that_ends_together_is_counted_while_it_decodes(tmp_path: Path) -> None:
    """Eight requests decode side by side for 10 s and finish in the same second: their tokens
    fall in the ten windows they were produced in, not all in the last, so the windows that
    the throughput interval resamples measure the server's pace, not when the batch ended."""
    batch = [
        {"request_id": f"batch-{i}", "ts": (T0 + timedelta(milliseconds=i)).isoformat() + "Z",
         "model": "m", "prompt_tokens": 100, "completion_tokens": 500, "ttft_ms": 1000.0,
         "e2e_ms": 11_000.0 - i, "status": "ok", "run_id": "batch"}
        for i in range(8)
    ]  # fmt: skip
    path = tmp_path / "s.duckdb"
    Store(path).add_events(batch)
    with Store(path).read() as con:
        got = Samples(con, Slice("batch")).window_totals(1.0, 11, {})
    assert got is not None
    assert got["input_tokens"][0] == pytest.approx(800, rel=0.01)  # prefill: the first second
    assert np.allclose(got["output_tokens"][1:], 400, rtol=0.01)  # 8 × 500 tokens over 10 s
    assert got["ok"].sum() == pytest.approx(8) and got["ok"].max() < 1


def test_a_total_of_mostly_distinct_values_resamples_them_exactly_as_counts_would() -> None:
    """Window totals of tokens are fractional (each request spread over its windows): almost
    every value distinct, they are resampled as they are; the same distribution as the
    Multinomial counts of distinct values, the same draws in any order, from the same seed."""
    values = np.random.default_rng(7).lognormal(5.0, 1.0, 3600)
    direct = bootstrap.total_draws(values)
    assert direct is not None
    draws = direct(np.random.default_rng(5))
    assert np.array_equal(draws, bootstrap.total_draws(values[::-1])(np.random.default_rng(5)))  # type: ignore[misc]
    sd = values.std() * math.sqrt(len(values))  # a sum of n draws with replacement
    assert abs(draws.mean() - values.sum()) < 4 * sd / math.sqrt(len(draws))
    assert 0.9 < draws.std() / sd < 1.1
    counted = np.round(values[:8], 0).repeat(450)  # few distinct values: Multinomial counts
    assert len(np.unique(counted)) * bootstrap.DISTINCT_SHARE <= len(counted)
    by_counts = bootstrap.total_draws(counted)
    assert by_counts is not None
    draws = by_counts(np.random.default_rng(5))
    sd = counted.std() * math.sqrt(len(counted))
    assert abs(draws.mean() - counted.sum()) < 4 * sd / math.sqrt(len(draws))
    assert 0.9 < draws.std() / sd < 1.1
