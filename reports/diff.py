"""Before/after: one row per indicator with Δ, Δ %, a seeded bootstrap 95 % CI and a verdict,
the headline sentence, and the warnings a reviewer needs before trusting the comparison.

A verdict is `unchanged` when the interval of Δ contains 0, otherwise `improved` or `regressed`
by the metric's direction (lower TTFT is better, higher throughput is better). A metric one side
did not measure is `not measured`, never a 0; a server counter ratio has no per-request samples
to resample, so it gets no interval and the verdict `not tested`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import duckdb
import numpy as np

from servescope.reports import bootstrap, gpu, sql
from servescope.reports.bootstrap import Draws, Floats
from servescope.reports.samples import FIXED_SOURCES, SERVER, TESTED, Samples

LOWER, HIGHER = "lower", "higher"
IMPROVED, REGRESSED, UNCHANGED = "improved", "regressed", "unchanged"
NOT_MEASURED, NOT_TESTED = "not measured", "not tested"
TOO_FEW = "too few samples"
# A bootstrap cannot see beyond the sample: a quantile's interval means something only with a
# few requests beyond it on each side (p95 needs 60 requests, p99 300).
MIN_TAIL_SAMPLES = 3
PROMPT_SIZE_TOLERANCE = 0.05


@dataclass(frozen=True)
class Side:
    """One side of a comparison: its summary (as in the report) and its per-request samples."""

    name: str
    summary: dict[str, Any]
    samples: Samples
    cache: dict[str, Any] = field(default_factory=dict)


Estimator = Callable[[Side], tuple[float | None, Draws | None]]


def _quantile(metric: str, q: float) -> Estimator:
    def estimate(side: Side) -> tuple[float | None, Draws | None]:
        values = side.samples.successful(metric)
        return bootstrap.quantile(values, q), bootstrap.quantile_draws(values, q)

    return estimate


def _error_rate(side: Side) -> tuple[float | None, Draws | None]:
    counts = side.samples.counts
    failed = counts.requests - counts.ok
    n = counts.requests
    return (failed / n if n else None), bootstrap.proportion_draws(failed, n)


def _cache_hit_share(side: Side) -> tuple[float | None, Draws | None]:
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
    totals = None
    if window is not None:
        good = side.summary["overall"]["goodput"]
        totals = side.samples.window_totals(window.width, window.count, good["slo"] if good else {})
    figures, draws = gpu.gpu_numbers(
        con,
        side.samples.part.run_id,
        window,
        totals["output_tokens"] if totals is not None else None,
        totals["ok"] if totals is not None else None,
    )
    side.summary["gpu"] = figures
    side.cache["gpu"] = draws


def _gpu(metric: str) -> Estimator:
    """A GPU figure of the side (reports/gpu.py) and its window-bootstrap draws."""
    key = metric.partition(".")[2]

    def estimate(side: Side) -> tuple[float | None, Draws | None]:
        return (side.summary.get("gpu") or {}).get(key), side.cache.get("gpu", {}).get(metric)

    return estimate


_TOTALS = {None: ("ok", "ok"), "prompt_tokens": ("input_tokens", "input_known"),
           "completion_tokens": ("output_tokens", "output_known")}  # fmt: skip


def _per_second(column: str | None) -> Estimator:
    """Successful requests (column None) or their tokens, per second of the side's duration."""
    total, known = _TOTALS[column]

    def estimate(side: Side) -> tuple[float | None, Draws | None]:
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


def _goodput(side: Side) -> tuple[float | None, Draws | None]:
    good = side.summary["overall"]["goodput"]
    seconds = side.summary["overall"]["throughput"]["duration_s"]
    if good is None or not seconds:
        return None, None
    windows = _windows(side, "good")
    draws = bootstrap.total_draws(windows, 1.0 / seconds) if windows is not None else None
    return good["good_requests"] / seconds, draws


def _server_ratio(side: Side) -> tuple[float | None, Draws | None]:
    return side.summary["server"]["prefix_cache_hit_ratio"], None


def _cached_token_ratio(side: Side) -> tuple[float | None, Draws | None]:
    return side.summary["overall"]["cached_token_ratio"], None


def _acceptance_rate(side: Side) -> tuple[float | None, Draws | None]:
    spec = side.summary["server"].get("spec_decode")
    return (spec or {}).get("acceptance_rate"), None


# (metric name in report.json, better direction, how to estimate it on one side)
INDICATORS: list[tuple[str, str, Estimator]] = [
    *[
        (f"{m}.{p}", LOWER, _quantile(m, q))
        for m in sql.REPORT_LATENCY_METRICS
        for p, q in TESTED.items()
    ],
    ("error_rate", LOWER, _error_rate),
    ("throughput.requests_per_s", HIGHER, _per_second(None)),
    ("throughput.input_tokens_per_s", HIGHER, _per_second("prompt_tokens")),
    ("throughput.output_tokens_per_s", HIGHER, _per_second("completion_tokens")),
    ("goodput.requests_per_s", HIGHER, _goodput),
    ("cache_hit_request_ratio", HIGHER, _cache_hit_share),
    ("cached_token_ratio", HIGHER, _cached_token_ratio),
    ("server.prefix_cache_hit_ratio", HIGHER, _server_ratio),
    ("server.spec_decode_acceptance_ratio", HIGHER, _acceptance_rate),
    # the GPU (reports/gpu.py): energy is a cost, utilisation the share of the GPU put to work
    ("gpu.j_per_output_token", LOWER, _gpu("gpu.j_per_output_token")),
    ("gpu.j_per_request", LOWER, _gpu("gpu.j_per_request")),
    ("gpu.mean_power_w", LOWER, _gpu("gpu.mean_power_w")),
    ("gpu.gpu_util_pct", HIGHER, _gpu("gpu.gpu_util_pct")),
]


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


def _too_few(metric: str, before: Side, after: Side) -> bool:
    """True for a quantile with fewer than MIN_TAIL_SAMPLES requests beyond it on a side."""
    column, _, name = metric.rpartition(".")
    if not name.startswith("p") or column not in sql.REPORT_LATENCY_METRICS:
        return False
    q = int(name[1:]) / 100
    n = min(len(before.samples.successful(column)), len(after.samples.successful(column)))
    return n * min(q, 1 - q) < MIN_TAIL_SAMPLES


def diff_rows(before: Side, after: Side, seed: int) -> list[dict[str, Any]]:
    rows = []
    for metric, better, estimate in INDICATORS:
        b, b_draws = estimate(before)
        a, a_draws = estimate(after)
        measured = a is not None and b is not None
        ci, ci_pct = bootstrap.delta_interval(b_draws, a_draws, seed, metric)
        delta = a - b if a is not None and b is not None else None
        verdict = _verdict(b, a, ci if measured else None, better)
        if measured and _too_few(metric, before, after):
            verdict = TOO_FEW
        column = metric.rpartition(".")[0]
        rows.append(
            {
                "metric": metric,
                "source": {**FIXED_SOURCES, **before.samples.sources}.get(column),
                "better": better,
                "before": b,
                "after": a,
                "delta": delta,
                "delta_pct": (delta / b * 100.0) if delta is not None and b else None,
                "ci95": list(ci) if ci and measured else None,
                "ci95_pct": list(ci_pct) if ci_pct and measured else None,
                "verdict": verdict,
            }
        )
    return rows


# -- the headline ---------------------------------------------------------------------------


def _signed_pct(value: float) -> str:
    if round(value) == 0:
        return "±0 %"
    return f"{'−' if value < 0 else '+'}{abs(value):.0f} %"


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.0f} %"


def _tested(name: str, row: dict[str, Any]) -> str:
    """A tested change as "TTFT p95 −81 % (−84 … −78 %) [improved]": the interval says why a
    large change can still be `unchanged` (bursty traffic over a few seconds gives throughput
    a wide one)."""
    ci = row["ci95_pct"]
    interval = f" ({_signed_pct(ci[0])[:-2]} … {_signed_pct(ci[1])})" if ci else ""
    return f"{name} {_signed_pct(row['delta_pct'])}{interval} [{row['verdict']}]"


def headline(change: str, rows: list[dict[str, Any]], before: Side, after: Side) -> str:
    """E.g. "enable_prefix_caching false → true: TTFT p95 −81 % (−84 … −78 %) [improved], prefix
    hit ratio 0 % → 93 %, throughput +12 % (+3 … +20 %) [improved]" (TTFT p50 when the runs are
    too small for a p95)."""
    for side in (before, after):
        if side.summary["overall"]["requests"] == 0:
            return f"{change}: {side.name} has no events, nothing to compare"
    by = {r["metric"]: r for r in rows}
    parts = []
    # the tail the seeds ask for (p95), or the median when the runs are too small to test a tail
    q = next((q for q in ("p95", "p50") if by[f"ttft_ms.{q}"]["verdict"] != TOO_FEW), "p95")
    ttft = by[f"ttft_ms.{q}"]
    if ttft["delta_pct"] is not None:
        parts.append(_tested(f"TTFT {q}" + (" (server)" if ttft["source"] == SERVER else ""), ttft))
    hit = by["server.prefix_cache_hit_ratio"]
    if hit["before"] is None or hit["after"] is None:
        hit = by["cached_token_ratio"]
    if hit["before"] is not None or hit["after"] is not None:
        parts.append(f"prefix hit ratio {_share(hit['before'])} → {_share(hit['after'])}")
    tput = by["throughput.output_tokens_per_s"]
    if tput["delta_pct"] is not None:
        parts.append(_tested("throughput", tput))
    elif by["throughput.requests_per_s"]["delta_pct"] is not None:
        # no token counts (e.g. `collect --once` on a log): the request rate still compares
        parts.append(_tested("requests/s", by["throughput.requests_per_s"]))
    energy = by["gpu.j_per_output_token"]
    if energy["delta_pct"] is not None:
        parts.append(_tested("energy per output token", energy))
    err = by["error_rate"]
    if err["verdict"] in (IMPROVED, REGRESSED):
        parts.append(f"error rate {_share(err['before'])} → {_share(err['after'])}")
    return f"{change}: " + (
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


def _level_name(g: dict[str, Any]) -> str:
    level = [f"concurrency {g['concurrency']}"] if g["concurrency"] is not None else []
    if g["target_rate"] is not None:
        level.append(f"rate {g['target_rate']:g}/s")
    return " · ".join([str(g["workload"] or "(no workload)"), *level])


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
    b_groups = {_level_name(g): g for g in before.summary["groups"]}
    a_groups = {_level_name(g): g for g in after.summary["groups"]}
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


def lever_changes(before: dict[str, Any], after: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"lever": k, "before": before.get(k), "after": after.get(k)}
        for k in sorted(set(before) | set(after), key=str)
        if before.get(k) != after.get(k)
    ]


def describe_change(changes: list[dict[str, Any]], fallback: str) -> str:
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
