"""Before/after: one row per indicator and load level with Δ, Δ %, a 95 % interval and a
verdict, the headline sentence, and the warnings a reviewer needs before trusting the comparison.

Each side is an arm: one or more runs of one configuration (its repeats). With several runs on
a side the interval covers run-to-run as well as request-to-request variation (a test on the
runs' values, reports/verdict.py); with one run a side it is the request-level bootstrap's, and
says it covers request noise only. Like is compared with like: a workload's level with the
same level of the other arm, never levels pooled (server counters and the GPU, which are not
per level, are rows of the whole run, labelled so).

The rows are one family: the primary indicator (the symptom the flipped lever targets, or
`--primary`) is tested at 5 %, every other row is corrected by Holm's procedure. A row is
`improved` or `regressed` only when significant after that, otherwise `unchanged`, next to the
smallest change the design could have found (80 % power). A metric one side did not measure is
`not measured`, never a 0; a figure with neither draws nor repeats is `not tested`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import duckdb
import numpy as np

from servescope.reports import bootstrap, gpu, sql, verdict
from servescope.reports.bootstrap import Draws, Floats
from servescope.reports.document import (
    Better,
    Decision,
    Design,
    DiffRow,
    Group,
    LeverChange,
    Summary,
)
from servescope.reports.judge import (
    AS_IS,
    LOG,
    STRATIFIED,
    WHOLE_RUN,
    Evidence,
    corrected_away,
    metric_name,
    missed,
    signed_pct,
)
from servescope.reports.samples import FIXED_SOURCES, TESTED, Samples, Sorted
from servescope.reports.verdict import (  # the vocabulary, for the modules that import it here
    IMPROVED,
    NOT_MEASURED,
    NOT_TESTED,
    REGRESSED,
    TOO_FEW,
    UNCHANGED,
)

LOWER: Better = "lower"
HIGHER: Better = "higher"
# A bootstrap cannot see beyond the sample: a quantile's interval means something only with a
# few requests beyond it on each side (p95 needs 60 requests, p99 300).
MIN_TAIL_SAMPLES = 3
PROMPT_SIZE_TOLERANCE = 0.05


@dataclass(frozen=True)
class Side:
    """One run (or a window of it) of a comparison: its summary (as in the report) and its
    per-request samples."""

    name: str
    summary: Summary
    samples: Samples
    cache: dict[str, dict[str, Draws | None]] = field(default_factory=dict)


@dataclass(frozen=True)
class Arm:
    """One side of a comparison: the runs of one configuration (its repeats)."""

    name: str
    repeats: list[Side]


# A load level as a report names it (`level_name`), and the group of a side's summary it is;
# WHOLE_RUN (judge.py): the run with every level it held (server counters and the GPU are not
# per level); STRATIFIED: every level, each weighted by its requests.
Level = Group | None  # a load level of the side's summary, or the whole run
Estimator = Callable[[Side, Level], tuple[float | None, Draws | None]]


def _group_counts(group: Group) -> tuple[int, int]:
    return int(group["requests"]), int(group["errors"])


def _quantile(metric: str, q: float) -> Estimator:
    def estimate(side: Side, group: Level) -> tuple[float | None, Draws | None]:
        values = _values(side, metric, group)
        if values is None:
            return None, None
        return bootstrap.quantile(values, q), bootstrap.quantile_draws(values, q)

    return estimate


def _values(side: Side, metric: str, group: Level) -> Sorted | None:
    """The metric's sorted values over the side's successful requests, at one level or all."""
    if group is None:
        return side.samples.successful(metric)
    key = side.samples.level_key(group["workload"], group["concurrency"], group["target_rate"])
    return None if key is None else side.samples.level_successful(metric).get(key)


def _error_rate(side: Side, group: Level) -> tuple[float | None, Draws | None]:
    if group is not None:
        n, failed = _group_counts(group)
    else:
        counts = side.samples.counts
        n, failed = counts.requests, counts.requests - counts.ok
    return (failed / n if n else None), bootstrap.proportion_draws(failed, n)


def _cache_hit_share(side: Side, group: Level) -> tuple[float | None, Draws | None]:
    if group is not None:
        return group["cache_hit_request_ratio"], None
    counts = side.samples.counts
    hits, known = counts.cache_hits, counts.cache_known
    return (hits / known if known else None), bootstrap.proportion_draws(hits, known)


def _windows(side: Side, column: str) -> Floats | None:
    """Per-window totals of `column` (of `Samples.window_totals`), by when each request
    completed.

    Throughput varies with time, not only with which requests ran, so its interval comes from
    resampling windows of the run (a block bootstrap): 1 s windows, or 1/20 of a shorter run.
    """
    found = throughput_windows(side)
    if found is None:
        return None
    width, count = found
    good = side.summary["overall"]["goodput"]
    totals = side.samples.window_totals(width, count, good["slo"] if good else {})
    return totals[column] if totals is not None else None


def throughput_windows(side: Side) -> tuple[float, int] | None:
    """(width, count) of the side's throughput windows: 1 s, or 1/20 of a shorter run."""
    seconds = side.summary["overall"]["throughput"]["duration_s"]
    if not seconds:
        return None
    width = 1.0 if seconds >= 20 else seconds / 20
    return width, max(1, int(np.ceil(seconds / width)))


def attach_gpu(con: duckdb.DuckDBPyConnection, side: Side) -> None:
    """The side's GPU figures (`summary["gpu"]`, see reports/gpu.py) over its throughput
    windows, and the draws of those a diff tests (`cache["gpu"]`)."""
    found, span = throughput_windows(side), side.samples.span
    window = gpu.Window(span[0], *found) if found and span else None

    def totals() -> tuple[Floats | None, Floats | None]:
        if window is None:
            return None, None
        good = side.summary["overall"]["goodput"]
        got = side.samples.window_totals(window.width, window.count, good["slo"] if good else {})
        return (got["output_tokens"], got["ok"]) if got is not None else (None, None)

    figures, draws = gpu.gpu_numbers(con, side.samples.part.run_id, window, totals)
    side.summary["gpu"] = figures
    side.cache["gpu"] = draws


def _gpu(metric: str) -> Estimator:
    """A GPU figure of the side (reports/gpu.py) and its window-bootstrap draws."""
    key = metric.partition(".")[2]

    def estimate(side: Side, group: Level) -> tuple[float | None, Draws | None]:
        figures = side.summary["gpu"]
        return (figures.get(key) if figures else None), side.cache.get("gpu", {}).get(metric)

    return estimate


_TOTALS = {None: ("ok", "ok"), "prompt_tokens": ("input_tokens", "input_known"),
           "completion_tokens": ("output_tokens", "output_known")}  # fmt: skip
Rate = Literal["requests_per_s", "input_tokens_per_s", "output_tokens_per_s"]
_LEVEL_RATES: dict[str | None, Rate] = {None: "requests_per_s",
                                        "prompt_tokens": "input_tokens_per_s",
                                        "completion_tokens": "output_tokens_per_s"}  # fmt: skip


def _per_second(column: str | None) -> Estimator:
    """Successful requests (column None) or their tokens, per second of the side's duration
    (of the level's own span, at a level of several: its rate has no draws of its own)."""
    total, known = _TOTALS[column]

    def estimate(side: Side, group: Level) -> tuple[float | None, Draws | None]:
        if group is not None:
            return group["throughput"][_LEVEL_RATES[column]], None
        seconds = side.summary["overall"]["throughput"]["duration_s"]
        counts = side.samples.counts
        if not seconds or counts.requests == 0:
            return None, None
        if column is not None and getattr(counts, known) == 0:
            return None, None
        windows = _windows(side, total)
        draws = bootstrap.total_draws(windows, 1.0 / seconds) if windows is not None else None
        return float(np.float64(getattr(counts, total)) / seconds), draws

    return estimate


def _goodput(side: Side, group: Level) -> tuple[float | None, Draws | None]:
    if group is not None:
        level_good = group["goodput"]
        return (level_good["requests_per_s"] if level_good else None), None
    good = side.summary["overall"]["goodput"]
    seconds = side.summary["overall"]["throughput"]["duration_s"]
    if good is None or not seconds:
        return None, None
    windows = _windows(side, "good")
    draws = bootstrap.total_draws(windows, 1.0 / seconds) if windows is not None else None
    return good["good_requests"] / seconds, draws


def _server_ratio(side: Side, group: Level) -> tuple[float | None, Draws | None]:
    return side.summary["server"]["prefix_cache_hit_ratio"], None


def _cached_token_ratio(side: Side, group: Level) -> tuple[float | None, Draws | None]:
    return (group or side.summary["overall"])["cached_token_ratio"], None


def _acceptance_rate(side: Side, group: Level) -> tuple[float | None, Draws | None]:
    spec = side.summary["server"].get("spec_decode")
    return (spec or {}).get("acceptance_rate"), None


@dataclass(frozen=True)
class Indicator:
    """A diff row's metric: its name in report.json, which way is better, how one run gives it
    (at a level, or over the whole run), whether it exists per level, and the scale its test
    works on (log: a lever scales it; as is: a share that sits at 0)."""

    metric: str
    better: Better
    estimate: Estimator
    per_level: bool = True
    scale: str = LOG


INDICATORS: list[Indicator] = [
    *[
        Indicator(f"{m}.{p}", LOWER, _quantile(m, q))
        for m in sql.REPORT_LATENCY_METRICS
        for p, q in TESTED.items()
    ],
    Indicator("error_rate", LOWER, _error_rate, scale=AS_IS),
    Indicator("throughput.requests_per_s", HIGHER, _per_second(None)),
    Indicator("throughput.input_tokens_per_s", HIGHER, _per_second("prompt_tokens")),
    Indicator("throughput.output_tokens_per_s", HIGHER, _per_second("completion_tokens")),
    Indicator("goodput.requests_per_s", HIGHER, _goodput),
    Indicator("cache_hit_request_ratio", HIGHER, _cache_hit_share, scale=AS_IS),
    Indicator("cached_token_ratio", HIGHER, _cached_token_ratio, scale=AS_IS),
    Indicator("server.prefix_cache_hit_ratio", HIGHER, _server_ratio, False, AS_IS),
    Indicator("server.spec_decode_acceptance_ratio", HIGHER, _acceptance_rate, False, AS_IS),
    # the GPU (reports/gpu.py): energy is a cost, utilisation the share of the GPU put to work
    Indicator("gpu.j_per_output_token", LOWER, _gpu("gpu.j_per_output_token"), False),
    Indicator("gpu.j_per_request", LOWER, _gpu("gpu.j_per_request"), False),
    Indicator("gpu.mean_power_w", LOWER, _gpu("gpu.mean_power_w"), False),
    Indicator("gpu.gpu_util_pct", HIGHER, _gpu("gpu.gpu_util_pct"), False),
]
BY_METRIC = {i.metric: i for i in INDICATORS}


def _verdict(
    before: float | None, after: float | None, ci: tuple[float, float] | None, better: str
) -> str:
    if before is None or after is None:
        return NOT_MEASURED
    if ci is None:
        return NOT_TESTED
    lo, hi = ci
    if lo <= 0.0 <= hi:
        return UNCHANGED
    got_lower = hi < 0.0
    return IMPROVED if got_lower == (better == LOWER) else REGRESSED


def _too_few(metric: str, counts: list[int]) -> str | None:
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


def level_name(group: Group) -> str:
    level = [f"concurrency {group['concurrency']}"] if group["concurrency"] is not None else []
    if group["target_rate"] is not None:
        level.append(f"rate {group['target_rate']:g}/s")
    return " · ".join([str(group["workload"] or "(no workload)"), *level])


def _groups(side: Side) -> dict[str, Group]:
    return {level_name(g): g for g in side.summary["groups"]}


def shared_levels(before: Arm, after: Arm) -> list[str]:
    """The load levels every run of both arms has, in the first after run's order."""
    names = [set(_groups(s)) for s in (*before.repeats, *after.repeats)]
    common = set.intersection(*names) if names else set()
    return [n for n in _groups(after.repeats[0]) if n in common]


def _pooled_quantile(
    sides: list[Side], metric: str, group_of: Callable[[Side], Level], q: float
) -> float | None:
    parts = []
    for side in sides:
        values = _values(side, metric, group_of(side))
        if values is None or len(values) == 0:
            return None
        parts.append(np.asarray(values[np.arange(len(values))], dtype=np.float64))
    merged = np.sort(np.concatenate(parts))
    return bootstrap.quantile(merged, q)


@dataclass
class Estimates:
    """One indicator at one level on every run of an arm: the runs' values, their request-level
    draws, and the arm's pooled value (requests of every repeat pooled for a quantile, the mean
    of the repeats otherwise)."""

    values: list[float | None]
    draws: list[Draws | None]
    pooled: float | None
    counts: list[int]


def _estimate(arm: Arm, indicator: Indicator, level: str | None) -> Estimates:
    def group_of(side: Side) -> Level:
        return None if level is None else _groups(side).get(level)

    values, draws, counts = [], [], []
    for side in arm.repeats:
        value, drawn = indicator.estimate(side, group_of(side))
        values.append(value)
        draws.append(drawn)
        column = indicator.metric.rpartition(".")[0]
        if column in sql.REPORT_LATENCY_METRICS:
            found = _values(side, column, group_of(side))
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


def _on_scale(values: Sequence[float | None], scale: str) -> Floats:
    """The values on the test's scale; a run without the value is NaN (numpy reads None so)."""
    array = np.asarray(values, dtype=np.float64)
    return np.log(array) if scale == LOG else array


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
        return row, _repeats_row(row, indicator, before, after, seed)
    if (few := _too_few(indicator.metric, before.counts + after.counts)) is not None:
        row["verdict"], row["too_few"] = TOO_FEW, few  # a bootstrap cannot see past the sample
        return row, Evidence()
    return row, _requests_row(row, indicator, before, after, seed)


def _repeats_row(
    row: DiffRow, indicator: Indicator, before: Estimates, after: Estimates, seed: int
) -> Evidence:
    """The row tested on the runs' values (reports/verdict.py), on the indicator's scale."""
    values = [v for v in (*before.values, *after.values) if v is not None]
    scale = indicator.scale if all(v > 0 for v in values) else AS_IS
    rng = np.random.default_rng([seed, *indicator.metric.encode(), *row["level"].encode()])

    def scaled_draws(est: Estimates) -> list[Floats | None]:
        out: list[Floats | None] = []
        for drawn in est.draws:
            if drawn is None:
                out.append(None)
                continue
            got = drawn(rng)
            out.append(_on_scale(list(got), scale) if scale == AS_IS or np.all(got > 0) else None)
        return out

    test = verdict.repeats_test(
        _on_scale(before.values, scale),
        _on_scale(after.values, scale),
        scaled_draws(before),
        scaled_draws(after),
    )
    if test is None:
        return Evidence()
    row["test"] = {
        "method": verdict.REPEATS,
        "scale": scale,
        "df": test.df,
        "spread": test.spread,
        "covers": "run-to-run and request noise",
        "request_share": test.request_share,
    }
    row["p_value"] = test.p_value
    return Evidence(float(np.sign(test.estimate)), test, scale)


def _requests_row(
    row: DiffRow, indicator: Indicator, before: Estimates, after: Estimates, seed: int
) -> Evidence:
    """One run a side: the request-level bootstrap's draws (request noise only)."""
    key = indicator.metric if row["level"] == WHOLE_RUN else f"{indicator.metric}@{row['level']}"
    b_draws, a_draws = before.draws[0], after.draws[0]
    if b_draws is None or a_draws is None:
        return Evidence()
    rng = np.random.default_rng([seed, *key.encode()])
    b, a = b_draws(rng), a_draws(rng)
    delta = a - b
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = (a / b - 1.0) * 100.0
    row["test"] = {
        "method": verdict.REQUESTS,
        "scale": AS_IS,
        "df": None,
        "spread": None,
        "covers": "request noise only",
    }
    row["p_value"] = verdict.draws_p_value(delta)
    return Evidence(
        float(np.sign(np.median(delta))), delta=delta, rel=rel if np.all(np.isfinite(rel)) else None
    )


def _weights(arm: Arm, levels: list[str]) -> list[float]:
    """Each level's weight in a stratified estimate: its share of the first run's requests
    (the workload fixes the shares; every run of both arms sends the same)."""
    groups = _groups(arm.repeats[0])
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


# -- the headline ---------------------------------------------------------------------------


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.0f} %"


def _tested(name: str, row: DiffRow) -> str:
    """A tested change as "TTFT p95 −81 % (−84 … −78 %) [improved]": the interval says why a
    large change can still be `unchanged` (bursty traffic over a few seconds gives throughput
    a wide one); an unchanged row says what the design could have missed."""
    ci, pct = row["ci95_pct"], row["delta_pct"]
    interval = f" ({signed_pct(ci[0])[:-2]} … {signed_pct(ci[1])})" if ci else ""
    found = f"{name} {signed_pct(pct or 0.0)}{interval} [{row['verdict']}]"
    if row["verdict"] == UNCHANGED and corrected_away(row):
        found += " (not after the correction for the report's other rows)"
    elif row["verdict"] == UNCHANGED and (words := missed(row)) is not None:
        found += f" ({words})"
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


def headline(change: str, rows: list[DiffRow], before: Arm, after: Arm, decided: Decision) -> str:
    """E.g. "enable_prefix_caching off → on (3 repeats a side): TTFT p50 over all load levels
    (stratified) improved: −81 % (−88 … −70 %) (99.2 % interval, 3 repeats a side), prefix hit
    ratio 0 % → 93 %, throughput +12 % (+3 … +20 %) [improved]": the decision first, then the
    prefix hits and throughput at the level it reads."""
    for arm in (before, after):
        for side in arm.repeats:
            if side.summary["overall"]["requests"] == 0:
                return f"{change}: {side.name} has no events, nothing to compare"
    kb, ka = len(before.repeats), len(after.repeats)
    if kb + ka <= 2:
        how = "one run a side: request noise only"
    elif kb == ka:
        how = f"{kb} repeats a side"
    else:
        how = f"{kb} repeats before, {ka} after"
    level = decided["level"]
    if level == WHOLE_RUN:  # a whole-run primary: the rest is read where the report leads
        level = next((r["level"] for r in rows if r["level"] != WHOLE_RUN), WHOLE_RUN)
    where = f"{how}; {level}" if level not in (WHOLE_RUN, STRATIFIED) else how
    by = at_level(rows, level)
    by[decided["metric"]] = next(
        (r for r in rows if r["metric"] == decided["metric"] and r["level"] == decided["level"]),
        by.get(decided["metric"]),
    )  # type: ignore[assignment]
    parts = []
    lead = by.get(decided["metric"])
    if lead is not None and decided["verdict"] != NOT_TESTED:
        parts.append(decided["words"])
    hit = by["server.prefix_cache_hit_ratio"]
    if hit["before"] is None or hit["after"] is None:
        hit = by["cached_token_ratio"]
    if hit["before"] is not None or hit["after"] is not None:
        parts.append(f"prefix hit ratio {_share(hit['before'])} → {_share(hit['after'])}")
    for metric in ("ttft_ms.p50", "throughput.output_tokens_per_s", "gpu.j_per_output_token"):
        row = by[metric]
        if row is not lead and row["delta_pct"] is not None:
            parts.append(_tested(metric_name(metric), row))
    if by["throughput.output_tokens_per_s"]["delta_pct"] is None:
        # no token counts (e.g. `collect --once` on a log): the request rate still compares
        rate = by["throughput.requests_per_s"]
        if rate["delta_pct"] is not None and rate is not lead:
            parts.append(_tested("requests/s", rate))
    err = by["error_rate"]
    if err["verdict"] in (IMPROVED, REGRESSED) and err is not lead:
        parts.append(f"error rate {_share(err['before'])} → {_share(err['after'])}")
    return f"{change} ({where}): " + (
        ", ".join(parts) if parts else "no TTFT, prefix hits or throughput measured on both sides"
    )


# -- apples to pears ------------------------------------------------------------------------


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b), key=str):
            out += _differences(a.get(key), b.get(key), f"{path}.{key}" if path else str(key))
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        out = []
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            name = x.get("name", i) if isinstance(x, dict) else i
            out += _differences(x, y, f"{path}[{name}]")
        return out
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def workload_warnings(
    before: Side, after: Side, before_spec: Any, after_spec: Any, same_run: bool
) -> list[str]:
    """Why the two sides may not be comparable: specs, levels, request counts, prompt sizes."""
    warnings = []
    if not same_run:
        if before_spec is None or after_spec is None:
            missing = [
                s.name for s, spec in ((before, before_spec), (after, after_spec)) if not spec
            ]
            warnings.append(
                f"workload spec not recorded for {', '.join(missing)}: compared by the measured "
                "requests only"
            )
        elif diffs := _differences(before_spec, after_spec):
            shown = "; ".join(diffs[:6]) + (f"; … {len(diffs) - 6} more" if len(diffs) > 6 else "")
            warnings.append(f"the workloads differ: {shown}")
    b_groups = {level_name(g): g for g in before.summary["groups"]}
    a_groups = {level_name(g): g for g in after.summary["groups"]}
    if only := sorted(set(b_groups) ^ set(a_groups)):
        warnings.append(f"load levels present on one side only: {', '.join(only)}")
    for name in sorted(set(b_groups) & set(a_groups)):
        b, a = b_groups[name], a_groups[name]
        if b["requests"] != a["requests"]:
            warnings.append(f"{name}: request counts differ ({b['requests']} vs {a['requests']})")
        bp, ap = b["prompt_tokens_mean"], a["prompt_tokens_mean"]
        if bp and ap and abs(ap - bp) / bp > PROMPT_SIZE_TOLERANCE:
            warnings.append(f"{name}: prompt sizes differ (mean {bp:,.0f} vs {ap:,.0f} tokens)")
    return warnings


def lever_changes(before: dict[str, Any], after: dict[str, Any]) -> list[LeverChange]:
    """Each lever whose recorded value differs between two runs (levers are free-form: the
    server flags that define a configuration)."""
    return [
        LeverChange(lever=k, before=before.get(k), after=after.get(k))
        for k in sorted(set(before) | set(after), key=str)
        if before.get(k) != after.get(k)
    ]


def describe_change(changes: list[LeverChange], fallback: str) -> str:
    if not changes:
        return fallback
    return "; ".join(
        f"{c['lever']} {_value(c['before'], c['lever'])} → {_value(c['after'], c['lever'])}"
        for c in changes[:4]
    ) + (f"; … {len(changes) - 4} more" if len(changes) > 4 else "")


def _value(value: Any, lever: str = "") -> str:
    if lever == "speculative_config":
        return speculation_name(value)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def speculation_name(value: Any) -> str:
    """`--speculative-config` as people say it: unset → `off`, `{"method": "ngram",
    "num_speculative_tokens": 3, …}` → `ngram k=3`; anything unparsable as given."""
    if value in (None, "default", False):
        return "off"
    try:
        config = json.loads(value) if isinstance(value, str) else value
    except ValueError:
        return str(value)
    if not isinstance(config, dict):
        return str(value)
    method = config.get("method") or config.get("model") or "speculation"
    k = config.get("num_speculative_tokens")
    return f"{method} k={k}" if k is not None else str(method)
