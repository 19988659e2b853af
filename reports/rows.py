"""Before/after: one row per indicator (reports/indicators.py) and load level with Δ, Δ %, a
95 % interval and a verdict, and the design the report states.

Each side is an arm: one or more runs of one configuration (its repeats). With several runs on
a side the interval covers run-to-run as well as request-to-request variation; with one run a
side it is the request-level bootstrap's, and says it covers request noise only
(reports/rowtest.py). With several load levels the rows are given at each level and over all
of them, each level weighted by its requests (`stratify`).

The rows are one family: the primary indicator (the symptom the flipped lever targets, or
`--primary`) is tested at 5 %, every other row is corrected by Holm's procedure
(reports/judge.py). A row is `improved` or `regressed` only when significant after that,
otherwise `unchanged`, next to the smallest change the design could have found (80 % power). A
metric one side did not measure is `not measured`, never a 0; a figure with neither draws nor
repeats is `not tested`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from servescope.reports import bootstrap, sql, verdict
from servescope.reports.bootstrap import Draws, Floats
from servescope.reports.document import Design, DiffRow
from servescope.reports.indicators import (
    INDICATORS,
    Arm,
    Indicator,
    Level,
    Side,
    groups_by_level,
    values_of,
)
from servescope.reports.judge import LOG, STRATIFIED, WHOLE_RUN, Evidence
from servescope.reports.rowtest import Estimates, repeats_evidence, requests_evidence
from servescope.reports.samples import FIXED_SOURCES, TESTED
from servescope.reports.verdict import NOT_MEASURED, NOT_TESTED, TOO_FEW, too_few


def shared_levels(before: Arm, after: Arm) -> list[str]:
    """The load levels every run of both arms has, in the first after run's order."""
    names = [set(groups_by_level(s)) for s in (*before.repeats, *after.repeats)]
    common = set.intersection(*names) if names else set()
    return [n for n in groups_by_level(after.repeats[0]) if n in common]


def _pooled_quantile(
    sides: list[Side], metric: str, group_of: Callable[[Side], Level], q: float
) -> float | None:
    parts = []
    for side in sides:
        values = values_of(side, metric, group_of(side))
        if values is None or len(values) == 0:
            return None
        parts.append(np.asarray(values[np.arange(len(values))], dtype=np.float64))
    merged = np.sort(np.concatenate(parts))
    return bootstrap.quantile(merged, q)


def _estimate(arm: Arm, indicator: Indicator, level: str | None) -> Estimates:
    def group_of(side: Side) -> Level:
        return None if level is None else groups_by_level(side).get(level)

    values, draws, counts = [], [], []
    for side in arm.repeats:
        value, drawn = indicator.estimate(side, group_of(side))
        values.append(value)
        draws.append(drawn)
        column = indicator.metric.rpartition(".")[0]
        if column in sql.REPORT_LATENCY_METRICS:
            found = values_of(side, column, group_of(side))
            counts.append(len(found) if found is not None else 0)
    known = [v for v in values if v is not None]
    pooled: float | None = None
    if len(known) == len(values) and known:
        pooled = known[0]
        if len(known) > 1:
            column, _, name = indicator.metric.rpartition(".")
            if column in sql.REPORT_LATENCY_METRICS:
                pooled = _pooled_quantile(arm.repeats, column, group_of, TESTED[name])
            else:
                pooled = float(np.mean(known))
    return Estimates(values, draws, pooled, counts)


def _row(
    indicator: Indicator,
    level: str,
    before: Estimates,
    after: Estimates,
    seed: int,
    source: str | None,
) -> tuple[DiffRow, Evidence]:
    """The row, with its test (p-value, method) and the evidence `judge` reads its interval
    and verdict from."""
    b, a = before.pooled, after.pooled
    delta = a - b if a is not None and b is not None else None
    row = DiffRow(
        metric=indicator.metric,
        level=level,
        source=source,
        better=indicator.better,
        before=b,
        after=a,
        delta=delta,
        delta_pct=(delta / b * 100.0) if delta is not None and b else None,
        ci95=None,
        ci95_pct=None,
        verdict=NOT_MEASURED if delta is None else NOT_TESTED,
        test=None,
        p_value=None,
        role=None,
        detectable=None,
        detectable_pct=None,
        repeats={"before": before.values, "after": after.values},
    )
    if delta is None:
        return row, Evidence()
    if len(before.values) + len(after.values) > 2:
        return row, repeats_evidence(row, indicator.metric, indicator.scale, before, after, seed)
    if (few := too_few(indicator.metric, before.counts + after.counts)) is not None:
        row["verdict"], row["too_few"] = TOO_FEW, few  # a bootstrap cannot see past the sample
        return row, Evidence()
    return row, requests_evidence(row, indicator.metric, before, after, seed)


def _weights(arm: Arm, levels: list[str]) -> list[float]:
    """Each level's weight in a stratified estimate: its share of the first run's requests
    (the workload fixes the shares; every run of both arms sends the same)."""
    groups = groups_by_level(arm.repeats[0])
    sizes = [float(groups[name]["requests"]) for name in levels]
    total = sum(sizes)
    return [size / total if total else 1.0 / len(levels) for size in sizes]


def stratify(
    weights: Sequence[float], values: Sequence[float], draws: Sequence[Draws | None], log: bool
) -> tuple[float, Draws | None]:
    """One run's value over its levels, and its draws: the levels' values weighted (`weights`,
    summing to 1) on the indicator's scale: a weighted geometric mean of times and rates (so
    that its change is the weighted mean of the levels' log changes), a weighted mean of
    shares. The draws combine the levels' draws alike (None unless every level has them), so
    the request noise stays a floor under the run's error."""
    pairs = list(zip(weights, values, strict=True))
    value = (
        float(np.exp(sum(w * np.log(v) for w, v in pairs)))
        if log
        else float(sum(w * v for w, v in pairs))
    )
    if not all(d is not None for d in draws):
        return value, None
    found = [d for d in draws if d is not None]

    def draw(rng: np.random.Generator) -> Floats:
        parts = [d(rng) for d in found]
        with np.errstate(divide="ignore"):
            if log:
                return np.exp(sum(w * np.log(p) for w, p in zip(weights, parts, strict=True)))
            return np.asarray(sum(w * p for w, p in zip(weights, parts, strict=True)))

    return value, draw


def _stratified(
    arm: Arm, indicator: Indicator, levels: list[str], weights: list[float]
) -> Estimates:
    """One value a run over every level (`stratify`), the arm's pooled value the runs' mean on
    the indicator's scale."""
    per = [_estimate(arm, indicator, level) for level in levels]
    log = indicator.scale == LOG
    values: list[float | None] = []
    draws: list[Draws | None] = []
    for r in range(len(arm.repeats)):
        parts = [p.values[r] for p in per]
        known = [v for v in parts if v is not None]
        if len(known) < len(parts) or (log and any(v <= 0 for v in known)):
            values.append(None)
            draws.append(None)
            continue
        value, drawn = stratify(weights, known, [p.draws[r] for p in per], log)
        values.append(value)
        draws.append(drawn)
    known = [v for v in values if v is not None]
    pooled = None
    if known and len(known) == len(values):
        pooled = float(np.exp(np.mean(np.log(known)))) if log else float(np.mean(known))
    runs = range(len(arm.repeats))
    counts = [min(p.counts[r] for p in per) for r in runs] if per[0].counts else []
    return Estimates(values, draws, pooled, counts)


def diff_rows(before: Arm, after: Arm, seed: int) -> tuple[list[DiffRow], list[Evidence]]:
    """Every indicator at every load level both arms ran (whole-run figures once) and, with
    several levels, over all of them (stratified), tested, with each row's evidence; verdicts
    are given by `judge`, which corrects the rows as a family."""
    levels = shared_levels(before, after)
    several = len(levels) > 1
    weights = _weights(after, levels) if several else []
    sources = {**FIXED_SOURCES, **before.repeats[0].samples.sources}
    tested = []
    for indicator in INDICATORS:
        source = sources.get(indicator.metric.rpartition(".")[0])
        if indicator.per_level and several:
            b = _stratified(before, indicator, levels, weights)
            a = _stratified(after, indicator, levels, weights)
            tested.append(_row(indicator, STRATIFIED, b, a, seed, source))
            for level in levels:
                b = _estimate(before, indicator, level)
                a = _estimate(after, indicator, level)
                tested.append(_row(indicator, level, b, a, seed, source))
            continue
        name = levels[0] if len(levels) == 1 and indicator.per_level else WHOLE_RUN
        b = _estimate(before, indicator, None)
        a = _estimate(after, indicator, None)
        tested.append(_row(indicator, name, b, a, seed, source))
    return [row for row, _ in tested], [found for _, found in tested]


def primary_level(before: Arm, after: Arm) -> str:
    """The level a report leads with: all levels (stratified) when there are several, else
    the one there is."""
    levels = shared_levels(before, after)
    if not levels:
        return WHOLE_RUN
    return STRATIFIED if len(levels) > 1 else levels[0]


def at_level(rows: list[DiffRow], level: str) -> dict[str, DiffRow]:
    """The rows a headline reads, by metric: the level's own, and the whole run's."""
    found = {r["metric"]: r for r in rows if r["level"] == WHOLE_RUN}
    found.update({r["metric"]: r for r in rows if r["level"] == level})
    return found


def design(before: Arm, after: Arm) -> Design:
    """How many repeats each arm had, and what the intervals cover."""
    kb, ka = len(before.repeats), len(after.repeats)
    one = kb + ka <= 2
    return Design(
        before=kb,
        after=ka,
        before_arm=before.name,
        after_arm=after.name,
        before_runs=[s.samples.part.run_id for s in before.repeats],
        after_runs=[s.samples.part.run_id for s in after.repeats],
        covers="request noise only" if one else "run-to-run and request noise",
        note=verdict.REQUEST_NOISE_ONLY if one else None,
    )
