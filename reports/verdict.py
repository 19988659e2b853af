"""The test behind every verdict: repeats (runs of one configuration) as the unit, the family of
a report's rows corrected around one primary indicator, and what "unchanged" could have missed.

Why per-run statistics. Runs move as a whole from one to the next (a restart, a warmer cache, a
neighbour on the GPU), so requests of one run are not independent draws of the configuration: a
bootstrap over requests, or over runs then requests, takes three runs for far more evidence than
they hold. docs/verdicts.md has the calibration that chose this method. Each arm's repeats give
one value each (TTFT p50 of the run, its throughput, …); the difference of the arms' means is
tested with Student's t on the pooled variance of those values (`k_before + k_after − 2`
degrees of freedom). Times and rates are compared as logarithms (a lever scales them), shares
and rates of failure as they are (they sit at 0).

The request noise inside each run is known from its bootstrap draws, and it is a floor under
the run-to-run variance: three runs can happen to agree more closely than their requests allow.
When that floor is the larger, it is the error used, still with Student's critical value: the
runs also drift, by an amount three values cannot pin down (the normal's value there called a
change in 8 % of synthetic A/A reports, docs/verdicts.md).

With one run a side there is nothing to estimate run-to-run variation from: the interval is the
request-level bootstrap's, and the report says that it covers request noise only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np

from servescope.reports import sql
from servescope.reports.bootstrap import Floats
from servescope.reports.document import Better

ALPHA = 0.05
# A row's verdict (report.json's `verdict`)
IMPROVED, REGRESSED, UNCHANGED, UNDECIDED = "improved", "regressed", "unchanged", "undecided"
NOT_MEASURED, NOT_TESTED = "not measured", "not tested"
TOO_FEW = "too few samples"
# Which way an indicator is better (a diff row's `better`)
LOWER: Better = "lower"
HIGHER: Better = "higher"
# A bootstrap cannot see beyond the sample: a quantile's interval means something only with a
# few requests beyond it on each side (p95 needs 60 requests, p99 300).
MIN_TAIL_SAMPLES = 3
# The other rows of a report, as one family (Holm): half the primary's level, so that the report
# as a whole (primary and family) calls a change in an A/A comparison about 5 % of the time.
FAMILY_ALPHA = 0.025
POWER_Z = 0.8416212335729143  # the normal's 80th percentile: 80 % power
REPEATS_CAP = 50  # "more than 50 repeats a side" is as good as never
REQUESTS, REPEATS = "requests", "repeats"
# What the interval of a design covers, said next to every verdict of a one-run-a-side report.
# Beyond this a percentage says nothing a reader can use (a queue time of 0.02 ms "could have
# grown 1,346,237 %"; two runs a side bound throughput's change at "+704,992,945,567,049,344 %"):
# a bound beyond it is shown as "> +1,000 %", the change in the indicator's units where it helps.
MAX_READABLE_PCT = 1000.0


def signed_change(value: float, digits: int = 0) -> str:
    """A change in percent, without its unit, as every report says it: a true minus sign, "±0"
    for one that rounds to nothing, "> +1,000" past MAX_READABLE_PCT (a time or a rate cannot
    fall below −100 %, so only the upper side runs away)."""
    if value > MAX_READABLE_PCT:
        return f"> +{MAX_READABLE_PCT:,.0f}"
    if round(value, digits) == 0:
        return f"±{0:.{digits}f}"
    return f"{'−' if value < 0 else '+'}{abs(value):,.{digits}f}"


REQUEST_NOISE_ONLY = (
    "one run a side: the interval covers request-to-request noise only; the design cannot tell "
    "the lever from run-to-run drift (give several runs a side: servescope report build A1 A2 A3 "
    "--vs B1 B2 B3)"
)


def normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def t_within(t: float, df: int) -> float:
    """P(|T| ≤ t) for Student's t with integer `df` (Abramowitz & Stegun 26.7.3–4, exact)."""
    t = abs(t)
    if df <= 0:
        raise ValueError("df must be positive")
    theta = math.atan(t / math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2 == 0:
        term, total = 1.0, 1.0
        for k in range(2, df, 2):
            term *= c2 * (k - 1) / k
            total += term
        return min(1.0, s * total)
    if df == 1:
        return 2.0 * theta / math.pi
    term, total = 1.0, 1.0
    for k in range(3, df, 2):
        term *= c2 * (k - 1) / k
        total += term
    return min(1.0, 2.0 / math.pi * (theta + s * math.cos(theta) * total))


@cache
def t_critical(df: int | None, alpha: float = ALPHA) -> float:
    """The two-sided critical value of Student's t (`df` None: the normal's)."""
    if df is None:
        return 1.959963984540054 if alpha == ALPHA else _normal_quantile(1 - alpha / 2)
    lo, hi = 0.0, 1000.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_within(mid, df) < 1 - alpha else (lo, mid)
    return (lo + hi) / 2


def _normal_quantile(p: float) -> float:
    lo, hi = -40.0, 40.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if normal_cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def two_sided_p(statistic: float, df: int | None) -> float:
    if df is None:
        return 2.0 * (1.0 - normal_cdf(abs(statistic)))
    return 1.0 - t_within(statistic, df)


@dataclass(frozen=True)
class Test:
    """One row's test on the chosen scale (log for times and rates, as is for shares).

    `estimate` is after − before on that scale, `error` its standard error, `df` the degrees of
    freedom (None: the normal's), `spread` one run's standard deviation on that scale (what
    sizes a future design), `request_share` the share of one run's variance its requests'
    noise makes (what sizes future runs: near 1, more requests a run buy more than more runs;
    None without request draws)."""

    method: str
    estimate: float
    error: float
    df: int | None
    spread: float | None
    request_share: float | None = None

    @property
    def critical(self) -> float:
        return t_critical(self.df)

    @property
    def p_value(self) -> float:
        if self.error <= 0.0:
            return 1.0 if self.estimate == 0.0 else 0.0
        return two_sided_p(self.estimate / self.error, self.df)

    @property
    def interval(self) -> tuple[float, float]:
        half = self.critical * self.error
        return self.estimate - half, self.estimate + half

    @property
    def detectable(self) -> float:
        """The smallest change on this scale the design finds 80 % of the time at 5 %."""
        return (self.critical + POWER_Z) * self.error


def repeats_test(
    before: Sequence[float] | Floats,
    after: Sequence[float] | Floats,
    before_draws: Sequence[Floats | None] = (),
    after_draws: Sequence[Floats | None] = (),
) -> Test | None:
    """Student's t on the arms' per-run values (already on the test's scale), with the request
    noise of each run (its bootstrap draws, on the same scale) as a floor under the error; None
    when there are too few runs to estimate run-to-run variation (fewer than three in all)."""
    kb, ka = len(before), len(after)
    df = kb + ka - 2
    if kb == 0 or ka == 0 or df < 1:
        return None
    b, a = np.asarray(before, np.float64), np.asarray(after, np.float64)
    squares = (((b - b.mean()) ** 2).sum() + ((a - a.mean()) ** 2).sum()) / df
    scale = math.sqrt(1.0 / kb + 1.0 / ka)
    run_error = math.sqrt(squares) * scale
    estimate = float(a.mean() - b.mean())
    spread = math.sqrt(squares)
    draws = [*before_draws, *after_draws]
    if len(draws) == kb + ka and all(d is not None and len(d) > 1 for d in draws):
        variances = [float(np.var(d)) for d in draws if d is not None]
        share = min(1.0, float(np.mean(variances)) / squares) if squares > 0 else 1.0
        floor = math.sqrt(sum(variances[:kb]) / kb**2 + sum(variances[kb:]) / ka**2)
        if floor > run_error:
            per_run = math.sqrt(float(np.mean(variances)))
            return Test(REPEATS, estimate, floor, df, max(spread, per_run), share)
        return Test(REPEATS, estimate, run_error, df, spread, share)
    return Test(REPEATS, estimate, run_error, df, spread)


def repeats_needed(spread: float | None, change: float, cap: int = REPEATS_CAP) -> int | None:
    """Repeats a side for a design of equal arms to find `change` (on the test's scale) 80 % of
    the time at 5 %, one run varying by `spread`; None when beyond `cap` or unknown."""
    if spread is None or change <= 0.0:
        return None
    if spread == 0.0:
        return 2
    for k in range(2, cap + 1):
        if (t_critical(2 * k - 2) + POWER_Z) * spread * math.sqrt(2.0 / k) <= change:
            return k
    return None


def holm(p_values: Sequence[float], alpha: float = ALPHA) -> list[bool]:
    """Which of a family's hypotheses Holm's step-down procedure rejects at family-wise `alpha`."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    rejected = [False] * len(p_values)
    m = len(p_values)
    for rank, i in enumerate(order):
        if p_values[i] > alpha / (m - rank):
            break
        rejected[i] = True
    return rejected


def holm_adjusted(p_values: Sequence[float]) -> list[float]:
    """Holm-adjusted p-values (a row is significant in its family when its value ≤ α)."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted = [1.0] * len(p_values)
    m, running = len(p_values), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def draws_p_value(delta_draws: Floats) -> float:
    """A bootstrap's two-sided p-value for "no change": twice the share of draws on the far
    side of 0 (the smallest a finite set of draws can show is 1/len)."""
    n = len(delta_draws)
    if n == 0:
        return 1.0
    below = float(np.count_nonzero(delta_draws <= 0.0)) / n
    above = float(np.count_nonzero(delta_draws >= 0.0)) / n
    return min(1.0, 2.0 * max(min(below, above), 1.0 / n))


def verdict_of(
    before: float | None, after: float | None, ci: tuple[float, float] | None, better: Better
) -> str:
    """A figure's verdict from its interval alone (no family to correct it with): `improved`
    or `regressed` where the interval of after − before excludes 0, `unchanged` where it
    covers it."""
    if before is None or after is None:
        return NOT_MEASURED
    if ci is None:
        return NOT_TESTED
    lo, hi = ci
    if lo <= 0.0 <= hi:
        return UNCHANGED
    got_lower = hi < 0.0
    return IMPROVED if got_lower == (better == LOWER) else REGRESSED


def too_few(metric: str, counts: list[int]) -> str | None:
    """Why one run a side cannot give a quantile an interval ("12 requests; p99 needs 300"):
    fewer than MIN_TAIL_SAMPLES requests beyond it; None when it can."""
    column, _, name = metric.rpartition(".")
    if not name.startswith("p") or column not in sql.REPORT_LATENCY_METRICS:
        return None
    q = int(name[1:]) / 100
    fewest = min(counts, default=0)
    if fewest * min(q, 1 - q) >= MIN_TAIL_SAMPLES:
        return None
    needs = math.ceil(MIN_TAIL_SAMPLES / min(q, 1 - q))
    return f"{fewest} requests; {name} needs {needs}"
