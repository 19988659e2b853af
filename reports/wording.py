"""A comparison in words: the headline sentence a report leads with, the warnings a reviewer
needs before trusting it (workloads, levels, request counts, prompt sizes that differ), and
the levers that changed as people say them (`enable_prefix_caching off → on`, `ngram k=3`)."""

from __future__ import annotations

import json
from typing import Any

from servescope.reports.document import Decision, DiffRow, LeverChange
from servescope.reports.indicators import Arm, Side, level_name
from servescope.reports.judge import (
    STRATIFIED,
    WHOLE_RUN,
    corrected_away,
    metric_name,
    missed,
    signed_pct,
)
from servescope.reports.rows import at_level
from servescope.reports.verdict import IMPROVED, NOT_TESTED, REGRESSED, UNCHANGED

PROMPT_SIZE_TOLERANCE = 0.05


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


def headline(change: str, rows: list[DiffRow], before: Arm, after: Arm, decided: Decision) -> str:
    """E.g. "enable_prefix_caching off → on (3 repeats a side): TTFT p50 over all load levels
    (stratified) improved: −81 % (−88 … −70 %) (99.2 % interval, 3 repeats a side), prefix hit
    ratio 0 % → 93 %, throughput +12 % (+3 … +20 %) [improved]": the decision first, then the
    prefix hits and throughput at the level it reads."""
    for arm in (before, after):
        for side in arm.repeats:
            if side.summary["overall"]["requests"] == 0:
                return f"{change}: {side.name} has no events, nothing to compare"
    how = _design_words(len(before.repeats), len(after.repeats))
    level = decided["level"]
    if level == WHOLE_RUN:  # a whole-run primary: the rest is read where the report leads
        level = next((r["level"] for r in rows if r["level"] != WHOLE_RUN), WHOLE_RUN)
    where = f"{how}; {level}" if level not in (WHOLE_RUN, STRATIFIED) else how
    by = at_level(rows, level)
    lead = next(
        (r for r in rows if r["metric"] == decided["metric"] and r["level"] == decided["level"]),
        by.get(decided["metric"]),
    )
    if lead is not None:
        by[decided["metric"]] = lead
    parts = [decided["words"]] if lead is not None and decided["verdict"] != NOT_TESTED else []
    parts += _also(by, lead)
    return f"{change} ({where}): " + (
        ", ".join(parts) if parts else "no TTFT, prefix hits or throughput measured on both sides"
    )


def _design_words(kb: int, ka: int) -> str:
    if kb + ka <= 2:
        return "one run a side: request noise only"
    return f"{kb} repeats a side" if kb == ka else f"{kb} repeats before, {ka} after"


def _also(by: dict[str, DiffRow], lead: DiffRow | None) -> list[str]:
    """What the headline says after the decision: prefix hits, TTFT, throughput (or the
    request rate where no tokens were counted), energy, and errors that changed."""
    parts = []
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
    return parts


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
