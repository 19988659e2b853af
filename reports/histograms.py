"""Quantiles of a Prometheus histogram, computed the way Prometheus's `histogram_quantile` does.

A report reads vLLM's histograms (queue, TTFT, prefill, decode) from the growth of their
cumulative `_bucket{le}` counters over a slice — from servescope's own scrapes or from a
Prometheus that scraped the same servers. Both go through this one function, so the two agree
exactly on equal bucket counts, and either differs from the requests' true quantile by at most
the width of the bucket it falls in (the bucket error).
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def bucket_bound(le: str) -> float:
    """A bucket's upper bound from its `le` label (`+Inf` included)."""
    return math.inf if le in ("+Inf", "Inf", "inf") else float(le)


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """The q-quantile (0-1) of cumulative buckets (upper bound, count), as Prometheus: the
    bucket holding rank q × total, linearly interpolated inside it from its lower bound (0 for
    the first bucket); a rank in the +Inf bucket gives the highest finite bound. None for an
    empty histogram or one without a +Inf bucket."""
    ordered = sorted(buckets)
    if not ordered or not math.isinf(ordered[-1][0]):
        return None
    total = ordered[-1][1]
    if total <= 0 or math.isnan(total):
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for i, (upper, count) in enumerate(ordered):
        if count >= rank:
            if math.isinf(upper):
                return ordered[i - 1][0] if i > 0 else None
            if i == 0 and upper <= 0:
                return upper
            if count == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return None
