"""The indicators a before/after diff compares, and how one run gives each: a quantile of the
successful requests' latencies, the error rate, throughput and goodput per second, prefix-cache
shares, draft acceptance, the GPU's energy and utilisation. Each is estimated on a `Side` (one
run, or a window of it), at one load level or over the whole run, with the draws of its
request-level (or window-level) bootstrap where it has them (reports/bootstrap.py).

Like is compared with like: a workload's level with the same level of the other arm, never
levels pooled (server counters and the GPU, which are not per level, are rows of the whole
run, labelled so). reports/rows.py builds the diff's rows from these."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import duckdb
import numpy as np

from servescope.reports import bootstrap, gpu, sql
from servescope.reports.bootstrap import Draws, Floats
from servescope.reports.document import Better, Group, Summary
from servescope.reports.judge import AS_IS, LOG
from servescope.reports.samples import TESTED, Samples, Sorted
from servescope.reports.verdict import HIGHER, LOWER


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
        values = values_of(side, metric, group)
        if values is None:
            return None, None
        return bootstrap.quantile(values, q), bootstrap.quantile_draws(values, q)

    return estimate


def values_of(side: Side, metric: str, group: Level) -> Sorted | None:
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

    def estimate(side: Side, _group: Level) -> tuple[float | None, Draws | None]:
        figures: Mapping[str, object] = side.summary["gpu"] or {}
        value = figures.get(key)
        figure = float(value) if isinstance(value, int | float) else None
        return figure, side.cache.get("gpu", {}).get(metric)

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


def _server_ratio(side: Side, _group: Level) -> tuple[float | None, Draws | None]:
    return side.summary["server"]["prefix_cache_hit_ratio"], None


def _cached_token_ratio(side: Side, group: Level) -> tuple[float | None, Draws | None]:
    return (group or side.summary["overall"])["cached_token_ratio"], None


def _acceptance_rate(side: Side, _group: Level) -> tuple[float | None, Draws | None]:
    spec = side.summary["server"]["spec_decode"]
    return (spec["acceptance_rate"] if spec else None), None


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


def level_name(group: Group) -> str:
    level = [f"concurrency {group['concurrency']}"] if group["concurrency"] is not None else []
    if group["target_rate"] is not None:
        level.append(f"rate {group['target_rate']:g}/s")
    return " · ".join([str(group["workload"] or "(no workload)"), *level])


def groups_by_level(side: Side) -> dict[str, Group]:
    return {level_name(g): g for g in side.summary["groups"]}
