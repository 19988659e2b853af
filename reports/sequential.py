"""The stopping rule of an experiment: repeats are added until the primary indicator is decided,
and what it then says stays true at 5 % however many looks it took.

Why repeated confidence intervals. An experiment that looks at its evidence after every round
of repeats and stops once it likes what it sees would, tested at 5 % each time, call a change
in an A/A comparison far more often than 5 % (ten looks: about 20 %). So every look reads the
primary's interval at one constant nominal level α′, chosen so that the intervals of *all*
the looks a plan allows cover the true change together with probability 95 % (a repeated
confidence interval with Pocock's constant boundary: Jennison & Turnbull, *Group Sequential
Methods with Applications to Clinical Trials*, 2000, ch. 9; Pocock, Biometrika 64, 1977).
Because the coverage is simultaneous, the experiment may stop at any look for any reason (the
primary decided, the budget ran out, Ctrl-C) and both readings of the interval hold at 5 %:

* it excludes no change: *improved* or *regressed*;
* it lies within ±margin (10 % by default): *unchanged within ±10 %* (the interval is the
  one-look equivalent of two one-sided tests at α′/2 each, so the claim is as safe as the
  other);
* neither: *undecided*, with about how many more repeats a side would decide.

α′ is found by simulation: under no change, the looks' Student t statistics on the runs'
values do not depend on how much runs vary (they are pivotal), so normal values with unit
variance give the joint law of the looks at once; α′ is the 5 % quantile of the smallest
p-value over the looks (three to twenty repeats a side: α′ ≈ 0.83 %, a 99.2 % interval at
every look). docs/verdicts.md has the calibration on runs that drift as real ones do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import numpy as np

from servescope.reports.verdict import (
    ALPHA,
    IMPROVED,
    REGRESSED,
    REPEATS_CAP,
    UNCHANGED,
    UNDECIDED,
    Test,
    t_critical,
)

FIRST_LOOK = 3  # repeats a side before the first look: fewer cannot estimate run-to-run spread
# repeats a side an experiment stops at, undecided, by default: the time budget usually ends it
# first; a runs' spread of 7 % reaches "unchanged within ±10 %" 89 % of the time by 20 (docs)
MAX_REPEATS = 20
MARGIN_PCT = 10.0  # "unchanged" means within ±10 % unless --margin says otherwise
SIMULATIONS = 100_000
SEED = 20261128


@dataclass(frozen=True)
class Plan:
    """The looks an experiment may take (after `first` … `last` repeats a side) and the margin
    within which a change counts as none, in percent."""

    first: int = FIRST_LOOK
    last: int = MAX_REPEATS
    margin_pct: float = MARGIN_PCT

    def covering(self, repeats: int) -> Plan:
        """The plan stretched to a comparison of `repeats` a side, when it has more."""
        return self if repeats <= self.last else Plan(self.first, repeats, self.margin_pct)

    @property
    def level(self) -> float:
        """α′: the two-sided level each look's interval is read at."""
        return look_level(self.first, self.last)

    @property
    def confidence(self) -> float:
        return 1.0 - self.level


def t_within_array(t: np.ndarray, df: int) -> np.ndarray:
    """P(|T| ≤ t) for Student's t with integer `df`, elementwise (reports/verdict.py's
    `t_within` over an array: Abramowitz & Stegun 26.7.3–4)."""
    theta = np.arctan(np.abs(t) / math.sqrt(df))
    s, c2 = np.sin(theta), np.cos(theta) ** 2
    term, total = np.ones_like(theta), np.ones_like(theta)
    if df % 2 == 0:
        for k in range(2, df, 2):
            term = term * c2 * (k - 1) / k
            total = total + term
        return np.asarray(np.minimum(1.0, s * total))
    if df == 1:
        return np.asarray(2.0 * theta / math.pi)
    for k in range(3, df, 2):
        term = term * c2 * (k - 1) / k
        total = total + term
    return np.asarray(np.minimum(1.0, 2.0 / math.pi * (theta + s * np.cos(theta) * total)))


@cache
def look_level(first: int, last: int, alpha: float = ALPHA) -> float:
    """The constant nominal level α′ at which looks after `first` … `last` repeats a side (two
    equal arms, Student's t on the pooled variance) keep a family-wise level of `alpha`."""
    if not 2 <= first <= last:
        raise ValueError(f"looks from {first} to {last} repeats a side: need 2 ≤ first ≤ last")
    rng = np.random.default_rng([SEED, first, last])
    smallest = np.ones(SIMULATIONS)
    b = rng.standard_normal((SIMULATIONS, last))
    a = rng.standard_normal((SIMULATIONS, last))
    sum_b, sum_a = np.cumsum(b, axis=1), np.cumsum(a, axis=1)
    sq_b, sq_a = np.cumsum(b * b, axis=1), np.cumsum(a * a, axis=1)
    for k in range(first, last + 1):
        mb, ma = sum_b[:, k - 1] / k, sum_a[:, k - 1] / k
        squares = sq_b[:, k - 1] - k * mb * mb + sq_a[:, k - 1] - k * ma * ma
        df = 2 * k - 2
        error = np.sqrt(np.maximum(squares, 1e-300) / df * 2.0 / k)
        smallest = np.minimum(smallest, 1.0 - t_within_array((ma - mb) / error, df))
    return float(np.quantile(smallest, alpha))


@dataclass(frozen=True)
class Reading:
    """One look at the primary: its verdict and the interval it read, on the test's scale."""

    verdict: str
    interval: tuple[float, float]
    confidence: float
    more_repeats: int | None  # undecided: about how many more a side would decide


def bounds(
    margin_pct: float, log_scale: bool, before: float | None, share: bool = False
) -> tuple[float, float] | None:
    """The margin on the test's scale: log(0.9) … log(1.1) for ±10 % of a time or a rate; for
    a share (an error rate, a hit ratio: a ratio of a value near 0 says nothing), a tenth of
    it in percentage points (±1 pp); else ±10 % of the before value (None where that is 0)."""
    m = margin_pct / 100.0
    if log_scale:
        return math.log(1.0 - m) if m < 1.0 else -math.inf, math.log(1.0 + m)
    if share:
        return -m / 10.0, m / 10.0
    if not before:
        return None
    return -abs(before) * m, abs(before) * m


def read(test: Test, plan: Plan, repeats: int, *, log_scale: bool, before: float | None,
         better_lower: bool, share: bool = False) -> Reading:  # fmt: skip
    """The primary's verdict at a look of `repeats` a side (the smaller arm)."""
    plan = plan.covering(repeats)
    level = plan.level
    critical = t_critical(test.df, level)
    lo, hi = test.estimate - critical * test.error, test.estimate + critical * test.error
    margin = bounds(plan.margin_pct, log_scale, before, share)
    if lo > 0.0 or hi < 0.0:
        verdict = IMPROVED if (hi < 0.0) == better_lower else REGRESSED
        return Reading(verdict, (lo, hi), 1.0 - level, None)
    if margin is not None and margin[0] <= lo and hi <= margin[1]:
        return Reading(UNCHANGED, (lo, hi), 1.0 - level, None)
    more = repeats_to_decide(test, repeats, level, margin)
    return Reading(UNDECIDED, (lo, hi), 1.0 - level, more)


def repeats_to_decide(
    test: Test, repeats: int, level: float, margin: tuple[float, float] | None
) -> int | None:
    """About how many more repeats a side would decide, were the change what this look
    estimates and one run to vary as much as these did: the first count whose interval at
    this level would exclude no change or fit the margin. None when more than the cap, or
    unknown (no spread measured)."""
    spread = test.spread
    if spread is None or test.df is None:
        return None
    estimate = abs(test.estimate)
    inside = min(-margin[0], margin[1]) if margin is not None else None
    for k in range(repeats + 1, REPEATS_CAP + 1):
        reach = t_critical(2 * k - 2, level) * spread * math.sqrt(2.0 / k)
        if estimate >= reach or (inside is not None and estimate + reach <= inside):
            return k - repeats
    return None
