"""Seeded bootstrap confidence intervals over per-request samples, exact and fast at any size.

A bootstrap resample draws n requests with replacement. Resampling a million requests two
thousand times would take minutes, so each statistic the report uses is drawn from its exact
bootstrap distribution instead, in O(draws) after one sort:

* a quantile (linear interpolation, DuckDB's `quantile_cont`): the k-th smallest of n uniform
  draws is Beta(k, n − k + 1), and the next one lies above it at (1 − u)·Beta(1, n − k); mapped
  through the sorted sample they are the resample's k-th and (k+1)-th order statistics;
* a proportion (error rate, cache-hit share): the resampled count is Binomial(n, p);
* a total (tokens for throughput): the resampled counts of each distinct value are
  Multinomial(n, shares); when most values are distinct (per-window totals of tokens spread
  over the windows their work spans), the n values themselves are drawn with replacement
  instead: the same distribution, at a cost in n rather than in n binomial draws per category.

The same seed gives the same draws, so a report is reproducible to the last digit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

DRAWS = 2000
# A total's values are resampled as they are rather than by Multinomial counts of its distinct
# values when more than 1/DISTINCT_SHARE of them are distinct (a binomial draw per category
# costs about what drawing DISTINCT_SHARE values does).
DISTINCT_SHARE = 8
DEFAULT_SEED = 20261122

Floats = NDArray[np.float64]
Draws = Callable[[np.random.Generator], Floats]


class SortedValues(Protocol):
    """Sorted values indexed by rank (an int or an array of ints): a numpy array, or
    `reports.samples.Sorted`, which keeps only the ranks a report reads."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: Any) -> Any: ...


def quantile(sorted_values: SortedValues, q: float) -> float | None:
    """The linear-interpolated quantile of sorted values (None for no values)."""
    n = len(sorted_values)
    if n == 0:
        return None
    h = (n - 1) * q
    lo = int(np.floor(h))
    hi = min(lo + 1, n - 1)
    return float(sorted_values[lo] + (h - lo) * (sorted_values[hi] - sorted_values[lo]))


def quantile_draws(sorted_values: SortedValues, q: float, draws: int = DRAWS) -> Draws | None:
    """Bootstrap draws of `quantile(sorted_values, q)`; None when there are no values."""
    n = len(sorted_values)
    if n == 0:
        return None

    def draw(rng: np.random.Generator) -> Floats:
        h = (n - 1) * q
        lo = int(np.floor(h))
        frac = h - lo
        k = lo + 1  # 1-based rank of the lower order statistic
        u_lo = rng.beta(k, n - k + 1, size=draws)
        low = sorted_values[np.minimum((u_lo * n).astype(np.int64), n - 1)]
        if k >= n or frac == 0.0:
            return low.astype(np.float64)
        u_hi = u_lo + (1.0 - u_lo) * rng.beta(1, n - k, size=draws)
        high = sorted_values[np.minimum((u_hi * n).astype(np.int64), n - 1)]
        return (low + frac * (high - low)).astype(np.float64)

    return draw


def proportion_draws(successes: int, n: int, draws: int = DRAWS) -> Draws | None:
    """Bootstrap draws of successes / n."""
    if n == 0:
        return None
    p = successes / n
    return lambda rng: rng.binomial(n, p, size=draws) / n


def total_draws(values: Floats, scale: float = 1.0, draws: int = DRAWS) -> Draws | None:
    """Bootstrap draws of sum(values) × scale (e.g. tokens ÷ duration = tokens/s)."""
    n = len(values)
    if n == 0:
        return None
    distinct, counts = np.unique(values, return_counts=True)
    shares = counts / n
    if len(distinct) * DISTINCT_SHARE > n:
        return _resampled_totals(np.sort(values), scale, draws)  # in any order, the same

    def draw(rng: np.random.Generator) -> Floats:
        chunk = max(1, 2_000_000 // len(distinct))  # bounded memory however many values
        parts = [
            rng.multinomial(n, shares, size=min(chunk, draws - start)) @ distinct
            for start in range(0, draws, chunk)
        ]
        return np.concatenate(parts).astype(np.float64) * scale

    return draw


def _resampled_totals(values: Floats, scale: float, draws: int) -> Draws:
    """Draws of sum(values) × scale over resamples of the values drawn with replacement."""
    n = len(values)

    def draw(rng: np.random.Generator) -> Floats:
        chunk = max(1, 2_000_000 // n)  # bounded memory however many values
        parts = [
            values[rng.integers(0, n, size=(min(chunk, draws - start), n))].sum(axis=1)
            for start in range(0, draws, chunk)
        ]
        return np.concatenate(parts).astype(np.float64) * scale

    return draw


def ratio_draws(numerators: Floats, denominators: Floats, draws: int = DRAWS) -> Draws | None:
    """Bootstrap draws of sum(numerators) ÷ sum(denominators), the pairs resampled together
    (windows of a run: each window's energy with its own tokens). None without pairs or
    without a positive denominator; a draw whose denominators sum to 0 (it drew only empty
    windows) counts as the sample's own ratio."""
    n = len(numerators)
    if n == 0 or len(denominators) != n:
        return None
    pairs = np.stack([np.asarray(numerators, np.float64), np.asarray(denominators, np.float64)])
    if pairs[1].sum() <= 0:
        return None
    whole = pairs[0].sum() / pairs[1].sum()

    def draw(rng: np.random.Generator) -> Floats:
        chunk = max(1, 2_000_000 // n)  # bounded memory however many windows
        parts = []
        for start in range(0, draws, chunk):
            counts = rng.multinomial(n, np.full(n, 1.0 / n), size=min(chunk, draws - start))
            top, bottom = counts @ pairs[0], counts @ pairs[1]
            with np.errstate(divide="ignore", invalid="ignore"):
                parts.append(np.where(bottom > 0, top / bottom, whole))
        return np.concatenate(parts)

    return draw


def delta_interval(
    before: Draws | None, after: Draws | None, seed: int, key: str
) -> tuple[tuple[float, float] | None, tuple[float, float] | None]:
    """95 % intervals of after − before and of (after ÷ before − 1) × 100, from independent
    draws of each side. `key` (the metric's name) seeds the draws so every metric has its own
    reproducible stream whatever the order metrics are computed in."""
    if before is None or after is None:
        return None, None
    rng = np.random.default_rng([seed, *key.encode()])
    b = before(rng)
    a = after(rng)
    delta = a - b
    lo, hi = np.percentile(delta, [2.5, 97.5])
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = (a / b - 1.0) * 100.0
    rel = rel[np.isfinite(rel)]
    pct = None
    if len(rel) == len(delta):
        p_lo, p_hi = np.percentile(rel, [2.5, 97.5])
        pct = (float(p_lo), float(p_hi))
    return (float(lo), float(hi)), pct
