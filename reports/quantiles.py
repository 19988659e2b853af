"""Exact quantiles (DuckDB's `quantile_cont`: linear interpolation between closest ranks) in
memory that does not grow with the run.

A quantile aggregate holds every value it is given; over a long-lived server's run (tens of
millions of requests, seven or more ITL gaps each) that is gigabytes. Only the order statistics
at two ranks per quantile are needed, so:

* `by_level`: a metric column already fetched (one value per request, with its level key) gives
  each level's order statistics by a partial sort of that level's values (`np.partition`).
* `pooled_itl`: up to IN_MEMORY gaps, fetched once, an array per level
  (`reports.sql.SLICE_LEVEL_GAPS`), each partially sorted, then all of them together: one pass
  over the gaps, 8 bytes a gap held (a third of the time of DuckDB's quantile aggregate, which
  needs two passes, overall and per level). Their means are exact (`exact_sum`). Beyond, the
  gaps are never fetched whole: a histogram of equal buckets per level
  (`reports.sql.SLICE_ITL_HISTOGRAM`) finds the bucket holding each wanted rank, and only
  those buckets' gaps are fetched (`SLICE_ITL_GAPS`); a bucket too full to fetch is split the
  same way over its own range. Four passes over the gaps (counts and means overall and per
  level, the histogram, the wanted buckets), a few megabytes held.

`quantile_cont` turns the two order statistics into the value with DuckDB's own ranks and
arithmetic, so every number is the double `quantile_cont` gave.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fractions import Fraction
from functools import cache
from typing import TypedDict

import duckdb
import numpy as np
from numpy.typing import NDArray

from servescope.reports import sql
from servescope.reports.bootstrap import Floats
from servescope.reports.sql import SliceParams

QUANTILES = (0.5, 0.9, 0.95, 0.99)
BUCKETS = 1 << 12  # per histogram pass (more: a bigger hash table costs more than the fetch saves)
FETCH_LIMIT = 1 << 20  # gaps of one bucket fetched at most; a fuller bucket is split again
IN_MEMORY = 1 << 23  # gaps a slice fetches whole (~64 MiB); more go by histogram selection
MAX_SPLITS = 4  # (a bucket still full after four splits holds copies of a few values)
OVERALL = None  # the group of every level pooled
_HOLDING = threading.Lock()  # one slice's gaps held at a time


def _ranks(n: int) -> list[int]:
    """The 0-based ranks `quantile_cont` reads for QUANTILES of n sorted values."""
    ranks = set()
    for q in QUANTILES:
        lo = int(math.floor((n - 1) * q))
        ranks |= {lo, min(lo + 1, n - 1)}
    return sorted(ranks)


@cache
def _fused() -> bool:
    """Whether this DuckDB build interpolates a double quantile as fma(lo, 1 − d, hi·d) (its C++
    `lo * (1.0 - d) + hi * d` contracted by the compiler, as on x86-64 with FMA) rather than with
    two roundings: asked once of DuckDB itself, so the numbers are the ones it would give."""
    lo, hi = 0.1, 0.7
    rows = [lo] * 5 + [hi] * 5  # quantile q interpolates between ranks 4 and 5 at d = 9q − 4
    qs = [0.45 + i / 1000 for i in range(1, 100)]
    with duckdb.connect() as con:
        got = con.execute(sql.QUANTILE_PROBE, {"qs": qs, "rows": rows}).fetchone()
    assert got is not None
    fused = plain = 0
    for q, value in zip(qs, got[0], strict=True):
        d = 9 * q - math.floor(9 * q)
        fused += value == _fma(lo, 1.0 - d, hi * d)
        plain += value == lo * (1.0 - d) + hi * d
    return fused > plain


def _fma(a: float, b: float, c: float) -> float:
    """a·b + c rounded once."""
    return float(Fraction(a) * Fraction(b) + Fraction(c))


def quantile_cont(n: int, at: Callable[[int], float], q: float) -> float:
    """DuckDB's `quantile_cont(x, q)` over n values, `at(rank)` giving the rank-th smallest:
    the same ranks and the same arithmetic, so the same double."""
    rn = (n - 1) * q
    frn, crn = math.floor(rn), math.ceil(rn)
    lo = at(frn)
    if crn == frn:
        return lo
    hi, d = at(crn), rn - frn
    if _fused() and math.isfinite(lo) and math.isfinite(hi):
        return _fma(lo, 1.0 - d, hi * d)
    return lo * (1.0 - d) + hi * d


def _quantiles(n: int, values: dict[int, float]) -> list[float | None]:
    return [quantile_cont(n, values.__getitem__, q) for q in QUANTILES]


def _order_quantiles(values: Floats) -> list[float | None]:
    """[p50, p90, p95, p99] of values, by a partial sort of them (in place)."""
    ranks = _ranks(len(values))
    values.partition(ranks)
    return _quantiles(len(values), {r: float(values[r]) for r in ranks})


def by_level(
    values: Floats, keys: NDArray[np.uint64], levels: Iterable[int]
) -> dict[int, list[float | None]]:
    """[p50, p90, p95, p99] of `values` per level key (levels without values are left out)."""
    out = {}
    for level in levels:
        mine = values[keys == np.uint64(level)]  # a copy: partially sorted in place
        if len(mine):
            out[level] = _order_quantiles(mine)
    return out


@dataclass
class _Want:
    """A rank still to find: of `group`'s gaps, `rank` counted from the low end of the range
    being searched."""

    group: int | None
    rank: int  # overall rank, to file the answer under
    within: int  # rank among the group's gaps in the current range


class Itl(TypedDict):
    """A slice's (or a level's) pooled ITL: [p50, p90, p95, p99] (None: no gaps) and the mean."""

    q: list[float | None] | None
    mean: float | None


def pooled_itl(
    con: duckdb.DuckDBPyConnection, params: SliceParams, gaps: int, levels: list[int]
) -> tuple[Itl, dict[int, Itl]]:
    """The pooled ITL of a slice with at most `gaps` gaps and these level keys (of its
    successful requests): {"q": [p50, p90, p95, p99] or None, "mean": …} overall and per
    level key."""
    if gaps <= IN_MEMORY:
        return _pooled_in_memory(con, params, levels)
    groups: dict[int | None, tuple[int, float | None, float | None, float | None]] = {}
    for n, lo, hi, mean in con.execute(sql.SLICE_ITL_STATS, params).fetchall():
        groups[OVERALL] = (n, lo, hi, mean)
    for key, n, lo, hi, mean in con.execute(sql.SLICE_GROUP_ITL_STATS, params).fetchall():
        groups[int(key)] = (n, lo, hi, mean)
    n_all, lo, hi, _ = groups.get(OVERALL, (0, None, None, None))
    found: dict[tuple[int | None, int], float] = {}
    if n_all and lo is not None and hi is not None:
        wants = [
            _Want(group, rank, rank)
            for group, (n, *_rest) in groups.items()
            if n
            for rank in _ranks(n)
        ]
        _find(con, params, lo, hi, wants, found)
    out: dict[int | None, Itl] = {}
    for group, (n, _lo, _hi, mean) in groups.items():
        q = None
        if n:
            q = _quantiles(n, {r: found.get((group, r), math.nan) for r in _ranks(n)})
        out[group] = Itl(q=q, mean=mean)
    overall = out.pop(OVERALL, Itl(q=None, mean=None))
    return overall, {k: v for k, v in out.items() if k is not None}


def _pooled_in_memory(
    con: duckdb.DuckDBPyConnection, params: SliceParams, levels: list[int]
) -> tuple[Itl, dict[int, Itl]]:
    """`pooled_itl` over the gaps fetched once with their level (NULL gaps left out; a level is
    there when its requests hold a gap, a NULL one too, as in an aggregate over the gaps). One
    slice at a time: a report's two sides would hold twice the memory."""
    with _HOLDING:
        rows = con.execute(sql.SLICE_LEVEL_GAPS, {**params, "levels": levels}).fetchnumpy()
        place = np.asarray(rows["level"], dtype=np.uint32)
        fetched = rows["gap"]
        del rows
        if isinstance(fetched, np.ma.MaskedArray):  # NULL gaps: their level counts, not they
            present = np.bincount(place, minlength=len(levels) + 1)
            kept = ~np.ma.getmaskarray(fetched)
            gaps = np.asarray(fetched.data[kept], dtype=np.float64)
            place = place[kept]
        else:
            gaps = np.require(fetched, dtype=np.float64, requirements="W")
            present = np.bincount(place, minlength=len(levels) + 1)
        del fetched
        out: dict[int, Itl] = {}
        total: int | float = 0
        for i, key in enumerate(levels, 1):
            if not present[i]:
                continue
            mine = gaps[place == i]  # a copy: partially sorted in place
            sum_ = exact_sum(mine)
            out[int(key)] = _itl(mine, sum_)
            total = _add(total, sum_)
        del place
        return _itl(gaps, total), out


def _itl(gaps: Floats, sum_: int | float) -> Itl:
    """The quantiles and mean of some gaps (partially sorted in place)."""
    if not len(gaps):
        return Itl(q=None, mean=None)
    return Itl(q=_order_quantiles(gaps), mean=_mean(sum_, len(gaps)))


# Exact sums: a double is m·2^e with an integer m of 53 bits; per exponent, the mantissas'
# halves (27 and 26 bits) are summed as doubles, exactly while a chunk's sum stays below 2^53.
_MANTISSA_BITS = 53
_LOW_BITS = 26
_MIN_EXPONENT = -1074 - _MANTISSA_BITS  # of the smallest subnormal's last bit
_EXPONENTS = 2048 + _MANTISSA_BITS + 1
_CHUNK = 1 << 20  # values summed per pass: |sum of halves| < 2^27 · 2^20 < 2^53


def exact_sum(values: Floats) -> int | float:
    """The exact sum of finite doubles, as an integer count of 2^_MIN_EXPONENT (whatever their
    order: the same gaps give the same mean from any store or lake); a float when one is NaN
    or infinite (their sum is)."""
    if not np.isfinite(values).all():
        return float(np.sum(values))
    total = 0
    for start in range(0, len(values), _CHUNK):
        mantissa, exponent = np.frexp(values[start : start + _CHUNK])
        whole = (mantissa * float(1 << _MANTISSA_BITS)).astype(np.int64)
        at = exponent - (_MIN_EXPONENT + _MANTISSA_BITS)  # 2^(e − 53) in units of the least
        high = np.bincount(at, weights=whole >> _LOW_BITS, minlength=_EXPONENTS)
        low = np.bincount(at, weights=whole & ((1 << _LOW_BITS) - 1), minlength=_EXPONENTS)
        for shift in np.flatnonzero(high.astype(bool) | low.astype(bool)):
            total += ((int(high[shift]) << _LOW_BITS) + int(low[shift])) << int(shift)
    return total


def _add(a: int | float, b: int | float) -> int | float:
    if isinstance(a, float) or isinstance(b, float):
        return float(a) + float(b)
    return a + b


def _mean(sum_: int | float, n: int) -> float:
    """The mean from an exact sum, correctly rounded."""
    if isinstance(sum_, float):
        return sum_ / n
    return float(Fraction(sum_, n << -_MIN_EXPONENT))


def _find(
    con: duckdb.DuckDBPyConnection,
    params: SliceParams,
    lo: float,
    hi: float,
    wants: list[_Want],
    found: dict[tuple[int | None, int], float],
    depth: int = 0,
) -> None:
    """Find each wanted rank among the gaps in [lo, hi] (ranks past them are NaN gaps)."""
    width = (hi - lo) / BUCKETS if hi > lo else 1.0
    bucket_params = {**params, "lo": lo, "hi": hi, "width": width, "last": BUCKETS - 1}
    rows = con.execute(sql.SLICE_ITL_HISTOGRAM, bucket_params).fetchnumpy()
    level = np.asarray(rows["level_key"], dtype=np.uint64)
    # per bucket, over every level: its gaps' count, min and max
    order, inverse = np.unique(np.asarray(rows["b"], dtype=np.int64), return_inverse=True)
    count = np.asarray(rows["n"], dtype=np.int64)
    total = np.zeros(len(order), dtype=np.int64)
    np.add.at(total, inverse, count)
    b_min = np.full(len(order), np.inf)
    np.minimum.at(b_min, inverse, np.asarray(rows["lo"], dtype=np.float64))
    b_max = np.full(len(order), -np.inf)
    np.maximum.at(b_max, inverse, np.asarray(rows["hi"], dtype=np.float64))
    fetch: dict[int, list[_Want]] = {}  # bucket -> ranks to read from its gaps
    split: dict[int, list[_Want]] = {}  # bucket index -> ranks to find by splitting it
    sizes: dict[int, int] = {}  # bucket -> its gaps (every level), for those fetched
    for group in {w.group for w in wants}:
        if group is OVERALL:
            counts = total
        else:
            mine = level == np.uint64(group)
            counts = np.zeros(len(order), dtype=np.int64)
            counts[inverse[mine]] = count[mine]
        cumulative = np.cumsum(counts)
        for want in (w for w in wants if w.group == group):
            i = int(np.searchsorted(cumulative, want.within, side="right"))
            if i == len(order):  # beyond every finite gap: a NaN one
                found[(group, want.rank)] = math.nan
                continue
            want.within -= int(cumulative[i - 1]) if i else 0
            if b_min[i] == b_max[i]:
                found[(group, want.rank)] = float(b_min[i])
            elif total[i] > FETCH_LIMIT and depth < MAX_SPLITS:
                split.setdefault(i, []).append(want)
            else:
                fetch.setdefault(int(order[i]), []).append(want)
                sizes[int(order[i])] = int(total[i])
    for batch in _batches(sizes):
        gaps = con.execute(sql.SLICE_ITL_GAPS, {**bucket_params, "buckets": batch}).fetchnumpy()
        g_level = np.asarray(gaps["level_key"], dtype=np.uint64)
        g_bucket = np.asarray(gaps["b"], dtype=np.int64)
        g_gap = np.asarray(gaps["gap"], dtype=np.float64)
        for b in batch:
            in_bucket = g_bucket == b
            for group in {w.group for w in fetch[b]}:
                mine = in_bucket if group is OVERALL else in_bucket & (g_level == np.uint64(group))
                ordered = np.sort(g_gap[mine])
                for want in (w for w in fetch[b] if w.group == group):
                    found[(group, want.rank)] = float(ordered[want.within])
    for i, bucket_wants in split.items():
        _find(con, params, float(b_min[i]), float(b_max[i]), bucket_wants, found, depth + 1)


def _batches(sizes: dict[int, int]) -> list[list[int]]:
    """Buckets in groups of at most FETCH_LIMIT gaps (a fuller bucket alone)."""
    batches: list[list[int]] = []
    held = FETCH_LIMIT
    for b in sorted(sizes):
        if held + sizes[b] > FETCH_LIMIT:
            batches.append([])
            held = 0
        batches[-1].append(b)
        held += sizes[b]
    return batches
