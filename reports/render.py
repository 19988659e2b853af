"""Render a report dict to HTML (one self-contained file), Markdown and JSON."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict, cast

from markupsafe import Markup

from servescope.reports import forest
from servescope.reports.document import DiffRow, Report
from servescope.reports.judge import (
    WHOLE_RUN,
    corrected_away,
    is_share,
    metric_name,
    missed,
    power_lines,
)
from servescope.reports.summary import LATENCY_METRICS, SERVER_METRICS
from servescope.reports.verdict import signed_change
from servescope.store.paths import inside

if TYPE_CHECKING:
    from jinja2 import Environment

FORMATS = ("html", "md", "json")
FILENAMES = {"html": "index.html", "md": "report.md", "json": "report.json"}


def fmt(value: Any, digits: int = 1) -> str:
    """Numbers for people: None is 'n/a', never 0."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def count(value: float | None) -> str:
    """A whole number with thousands separators; 'n/a' when not stated."""
    return "n/a" if value is None else f"{value:,.0f}"


def times(value: float | None, digits: int = 2) -> str:
    """A multiplier ("128.00x"); a missing one is 'n/a' alone, never 'n/ax'."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:,.{digits}f}x"


def pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.1f} %"


def signed(value: float | None, digits: int = 1, unit: str = "") -> str:
    """A change with its sign (a true minus sign), 'n/a' when not measured."""
    if value is None:
        return "n/a"
    sign = "−" if value < 0 else "+"
    return f"{sign}{abs(value):,.{digits}f}{unit}"


def interval(ci: list[float] | None, digits: int = 1, unit: str = "") -> str:
    if not ci:
        return "n/a"
    return f"{signed(ci[0], digits)} … {signed(ci[1], digits)}{unit}"


def value_of(row: DiffRow, key: Literal["before", "after"]) -> str:
    """A diff row's before/after value in the metric's own unit."""
    value = row[key]
    if row["metric"].endswith("ratio") or row["metric"] == "error_rate":
        return pct(value)
    return fmt(value, 2)


def delta_of(row: DiffRow) -> str:
    if row["metric"].endswith("ratio") or row["metric"] == "error_rate":
        return "n/a" if row["delta"] is None else signed(row["delta"] * 100, 1, " pp")
    return signed(row["delta"], 2)


def ci_of(row: DiffRow) -> str:
    if row["metric"].endswith("ratio") or row["metric"] == "error_rate":
        ci = row["ci95"]
        return interval([c * 100 for c in ci], 1, " pp") if ci else "n/a"
    return interval(row["ci95"], 2)


def _is_share(row: DiffRow) -> bool:
    return is_share(row["metric"])


def repeats_of(row: DiffRow, side: Literal["before", "after"]) -> str:
    """Each repeat's value of a side, in the metric's unit ("" for one run a side)."""
    values = row["repeats"][side]
    if len(values) < 2:
        return ""
    return ", ".join(pct(v) if _is_share(row) else fmt(v, 1) for v in values)


def verdict_of(row: DiffRow) -> str:
    """The verdict with what it rests on: the primary indicator, what "unchanged" could have
    missed, and a one-run design's request noise."""
    text = row["verdict"]
    if row["role"] == "primary":
        text += " (primary)"
    if row["verdict"] == "unchanged" and corrected_away(row):
        text += ": a change alone, not after the correction for the other rows"
    elif row["verdict"] in ("unchanged", "undecided") and (words := missed(row)) is not None:
        text += f": {words}"
    elif row["verdict"] == "too few samples" and row.get("too_few"):
        text += f" ({row['too_few']})"
    if (test := row["test"]) is not None and test["method"] == "requests":
        text += " [request noise only]"
    return text


def _cpu_server(side: Any) -> bool:
    """vLLM stated the side's KV cache in CPU memory: a server without a GPU."""
    kv = (side.get("run") or {}).get("kv_cache") or {}
    return (kv.get("vllm") or {}).get("kv_cache_device") == "CPU"


def unmeasured(report: Report) -> list[tuple[str, list[str]]]:
    """A diff's rows without a figure on one side or both, by why: a figure that could have been
    measured and was not is "not measured"; one the runs could not have (goodput without an SLO,
    speculative decoding's rows with it off on both sides, GPU rows of two CPU servers) says why
    it does not apply instead."""
    rows = [d["metric"] for d in report.get("diff", []) if d["verdict"] == "not measured"]
    names = list(dict.fromkeys(rows))
    sides: list[Any] = [report.get("before") or {}, report.get("after") or {}]
    speculating = any("speculative_config" in (side.get("levers") or {}) for side in sides)
    reasons = {
        "no SLO given (--slo)": [n for n in names if n.startswith("goodput.")]
        if not report.get("slo") else [],
        "no speculative decoding on either side": [n for n in names
                                                   if n.startswith("server.spec_decode")]
        if not speculating else [],
        "no GPU on either side (CPU servers)": [n for n in names if n.startswith("gpu.")]
        if all(_cpu_server(side) for side in sides) else [],
    }  # fmt: skip
    explained = {n for group in reasons.values() for n in group}
    out = [("Not measured (on one side or both)", [n for n in names if n not in explained])]
    out += [(f"Not applicable, {why}", group) for why, group in reasons.items()]
    return [(label, group) for label, group in out if group]


def repeat_strip(row: DiffRow) -> Markup:
    """Each repeat's value as a dot on one axis, before (grey) above after (blue), the pooled
    values as ticks: the spread between repeats beside the change. Numbers only reach the SVG."""
    repeats = row["repeats"]
    before = [float(v) for v in repeats["before"] if v is not None]
    after = [float(v) for v in repeats["after"] if v is not None]
    if len(before) + len(after) <= 2:
        return Markup("")
    pooled = [float(v) for v in (row["before"], row["after"]) if v is not None]
    everything = before + after + pooled
    lo, hi = min(everything), max(everything)
    span = hi - lo or abs(hi) or 1.0
    width, pad = 120.0, 4.0

    def x(v: float) -> float:
        return pad + (v - lo) / span * (width - 2 * pad)

    parts = [
        f'<svg class="strip" width="{width:.0f}" height="22" viewBox="0 0 {width:.0f} 22" '
        'role="img"><title>each repeat: before (grey, top), after (blue, bottom)</title>'
    ]
    for y, values, colour in ((6.0, before, "#8c959f"), (16.0, after, "#0969da")):
        parts += [f'<circle cx="{x(v):.1f}" cy="{y}" r="2.6" fill="{colour}"/>' for v in values]
    for y, v in zip((6.0, 16.0), (row["before"], row["after"]), strict=True):
        if v is not None:
            cx = x(float(v))
            parts.append(f'<line x1="{cx:.1f}" x2="{cx:.1f}" y1="{y - 5}" y2="{y + 5}" '
                         'stroke="#24292f" stroke-width="1"/>')  # fmt: skip
    parts.append("</svg>")
    return Markup("".join(parts))


def arms_title(report: Report) -> str | None:
    """ "default ×5 vs no-prefix-caching ×5": a comparison of repeats named by its arms, after
    first (the runs under test), each with its repeats. None for one run a side, whose title
    keeps the two run ids, and for a split or a single run."""
    view = cast(Mapping[str, Any], report)
    design = view.get("repeats") or {}
    before, after = design.get("before", 1), design.get("after", 1)
    if view.get("kind") != "diff" or max(before, after) < 2:
        return None
    after_name = design.get("after_arm") or (view.get("after") or {}).get("name") or view["run_id"]
    before_name = design.get("before_arm") or (view.get("before") or {}).get("name") or "before"
    return f"{after_name} ×{after} vs {before_name} ×{before}"


def _change(metric: str, estimate: Any, ci_pct: Any, ci: Any, delta: Any) -> str:
    """The change and its interval: % of the before value; points (pp) for a share, whose %
    of a before value near 0 says nothing."""
    if forest.is_share(metric):
        if delta is None:
            return "n/a"
        within = f" ({interval([v * 100 for v in ci], 1, ' pp')})" if ci else ""
        return f"{signed(delta * 100, 1, ' pp')}{within}"
    if estimate is None:
        return "n/a"
    within = f" ({signed_change(ci_pct[0], 1)} … {signed_change(ci_pct[1], 1)} %)" if ci_pct else ""
    return f"{signed_change(estimate, 1)} %{within}"


def _value(metric: str, value: Any) -> str:
    """A before or after value of the decision's indicator, in its unit."""
    if value is None:
        return "n/a"
    if forest.is_share(metric):
        return pct(value)
    unit = " ms" if "_ms." in metric else " tokens/s" if metric.endswith("tokens_per_s") else ""
    return f"{fmt(float(value), 1)}{unit}"


def _where(metric: str, level: str) -> str:
    """ "TTFT p50 at chat · concurrency 4", as the decision's own sentence names it."""
    if level == forest.STRATIFIED:
        return f"{metric_name(metric)} over all load levels (stratified)"
    return metric_name(metric) + ("" if level == WHOLE_RUN else f" at {level}")


def forest_where(report: Report) -> str:
    """Where the forest's lines are read, for its caption: "over all load levels (stratified)",
    "at chat · concurrency 4", "over the whole run"."""
    level = forest.main_level(cast(Mapping[str, Any], report))
    if level == forest.STRATIFIED:
        return "over all load levels (stratified)"
    return "over the whole run" if level in (None, WHOLE_RUN) else f"at {level}"


def _sentence(text: str) -> str:
    """A phrase as a sentence: capital first, full stop last."""
    text = text.strip()
    if not text:
        return text
    return text[0].upper() + text[1:] + ("" if text[-1] in ".!?" else ".")


class DecisionView(TypedDict):
    """The first screen's decision, as the templates show it: every figure already words."""

    verdict: str
    words: str
    before: str
    after: str
    change: str
    interval: str
    margin: str | None
    confidence: str
    stopped: str


def decision_of(report: Report) -> DecisionView | None:
    """What the first screen says: the primary indicator's verdict, its change and interval,
    and why the experiment stopped. From report.json's `decision` (its one sentence, `words`,
    leads) when it has one; an older report reads its primary row instead, at 95 %, and says
    that no stopping rule ran. None for a report that compares nothing."""
    view = cast(Mapping[str, Any], report)
    rows = view.get("diff") or []
    if view.get("kind") not in ("diff", "split") or not rows:
        return None
    design = view.get("repeats") or {}
    found = view.get("decision")
    if found:
        metric, level = found["metric"], found["level"]
        before, after = found.get("before"), found.get("after")
        confidence = float(found.get("confidence") or 0.95)
        change = _change(metric, found.get("estimate_pct"), found.get("interval_pct"),
                         found.get("interval"), None if before is None or after is None
                         else after - before)  # fmt: skip
        words = found.get("words") or f"{_where(metric, level)} {found['verdict']}: {change}"
        margin = found.get("margin_pct")
        return DecisionView(
            verdict=found.get("verdict") or "not tested", words=words,
            before=_value(metric, before), after=_value(metric, after), change=change,
            interval=f"the {confidence * 100:.3g} % interval is a repeated one: it holds "
            "however many looks the experiment took" if confidence > 0.951
            else f"{confidence * 100:.3g} % interval",
            margin=f"±{float(forest.MARGIN_PCT if margin is None else margin):g} %",
            confidence=f"{confidence * 100:.3g} % interval",
            stopped=_sentence(found.get("reason") or ""),
        )  # fmt: skip
    primary = view.get("primary") or {}
    row = next((r for r in rows if r.get("role") == "primary"), None) or next(
        (r for r in rows
         if r["metric"] == primary.get("metric") and r["level"] == primary.get("level")), None
    )  # fmt: skip
    if row is None:
        return None
    metric = row["metric"]
    change = _change(metric, row["delta_pct"], row["ci95_pct"], row["ci95"], row["delta"])
    kb, ka = design.get("before", 1), design.get("after", 1)
    return DecisionView(
        verdict=row["verdict"], words=f"{_where(metric, row['level'])} {row['verdict']}: "
        f"{change}", before=_value(metric, row["before"]),
        after=_value(metric, row["after"]), change=change, interval="95 % interval",
        margin=None, confidence="95 % interval",
        stopped=f"Stored runs compared ({ka} after, {kb} before): no stopping rule ran.",
    )  # fmt: skip


# What could start Markdown of its own inside a value: emphasis, code, links and images, HTML
# tags and entities, table cells, strikethrough, a heading's closing marks. CommonMark reads
# a backslash before any ASCII punctuation as that character itself; an underscore inside a word
# (`max_num_seqs`) starts nothing, so it stays as it is.
_MARKDOWN_SPECIAL = re.compile(r"[\\`*\[\]<&|~#]|(?<![^\W_])_|_(?![^\W_])")


def md_escape(value: Any) -> Markup:
    """A value as Markdown text that shows exactly it: its special characters backslash-escaped
    (never HTML entities, which a Markdown file shows as they are), on one line (a line break
    would end a table row or a list item). A viewer that renders it to HTML gets text, never a
    tag. (`Markup`: done, so the template's autoescape leaves it as it is.)"""
    return Markup(_MARKDOWN_SPECIAL.sub(r"\\\g<0>", _one_line(value)))


def md_code(value: Any) -> Markup:
    """A value as a Markdown code span, which shows its text as it is; one holding what a code
    span cannot (a backtick, a table's `|`) or nothing but spaces is escaped text instead."""
    text = _one_line(value)
    if not text.strip() or "`" in text or "|" in text:
        return md_escape(text)
    return Markup(f"`{text}`")


def _one_line(value: Any) -> str:
    return " ".join(str(value).splitlines())


def _markdown_value(value: Any) -> Any:
    """Every value a Markdown template writes, escaped as Markdown; what a macro wrote or a
    filter made Markdown already (`Markup`) is left as it is."""
    return value if hasattr(value, "__html__") else md_escape(value)


def _environment(fmt_name: str) -> Environment:
    # imported here: a JSON-only report (what scripts ask for) never pays for jinja2
    from jinja2 import Environment, PackageLoader, StrictUndefined

    # HTML is autoescaped as HTML. Markdown too is autoescaped, after `finalize` has escaped
    # each value as Markdown (`Markup`, which autoescape passes through): a macro's output, made
    # of escaped values, is not escaped again.
    markdown = fmt_name == "md"
    env = Environment(
        loader=PackageLoader("servescope.reports", "templates"),
        autoescape=True,
        finalize=_markdown_value if markdown else None,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    if markdown:
        env.filters["code"] = md_code
    env.filters["fmt"] = fmt
    env.filters["pct"] = pct
    env.filters["count"] = count
    env.filters["times"] = times
    env.filters["signed"] = signed
    env.filters["interval"] = interval
    env.filters["value_of"] = value_of
    env.filters["delta_of"] = delta_of
    env.filters["ci_of"] = ci_of
    env.filters["repeats_of"] = repeats_of
    env.filters["verdict_of"] = verdict_of
    env.filters["repeat_strip"] = repeat_strip
    env.globals["power_lines"] = power_lines
    env.globals["unmeasured"] = unmeasured
    env.globals["arms_title"] = arms_title
    env.globals["decision_of"] = decision_of
    env.globals["forest"] = forest.forest_svg
    env.globals["forest_left_out"] = forest.unmeasured
    env.globals["forest_margin"] = forest.margin_of
    env.globals["forest_where"] = forest_where
    return env


def render(report: Report, fmt_name: str) -> str:
    """The report as one document; JSON holds the numbers (charts are for the HTML)."""
    if fmt_name == "json":
        data = {k: v for k, v in report.items() if k != "charts"}
        return json.dumps(data, indent=2, default=str) + "\n"
    env = _environment(fmt_name)
    charts = {k: Markup(v) for k, v in report.get("charts", {}).items()}  # escaped in svg.py
    return env.get_template(f"report.{fmt_name}.j2").render(
        r=report, charts=charts, metrics=LATENCY_METRICS, server_metrics=SERVER_METRICS
    )


def write_report(report: Report, out: Path, formats: tuple[str, ...] = FORMATS) -> list[Path]:
    """Write `out/<report_id>/{index.html,report.md,report.json}`; returns the paths written.
    The folder's name is `store.paths.safe_name(report_id)`: a run id is data, never a path."""
    out.mkdir(parents=True, exist_ok=True)
    folder = inside(out, report["report_id"])
    folder.mkdir(exist_ok=True)
    paths = []
    for name in formats:
        path = folder / FILENAMES[name]
        path.write_text(render(report, name), encoding="utf-8")
        paths.append(path)
    return paths
