"""The forest plot a comparison's report opens with: one line per core indicator, its change as a
dot and the interval its verdict reads as a bar, against a line at no change and the ±margin
band within which a change counts as none (reports/sequential.py), coloured by the row's verdict.

Why a forest plot: the decision names one indicator, but a flip that helps TTFT and costs
throughput or errors must show that at a glance; eight rows of a 50-row table do not. Hand-made
SVG like reports/svg.py (the report stays one file with no script). Every string that reaches
the SVG is escaped here.

Scales. A time or a rate is drawn as Δ % of its before value. A share (error rate, prefix-cache
hit ratio) is drawn in percentage points: its Δ % is relative to a value near 0 and can run to
millions of percent, which would flatten every other line. Whatever is left beyond the axis's
range (−100 … +300) is cut at the edge and ends in an arrow, so nothing stretches the axis.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from html import escape
from typing import Any

from markupsafe import Markup

from servescope.reports.judge import STRATIFIED, WHOLE_RUN, is_share
from servescope.reports.sequential import MARGIN_PCT
from servescope.reports.svg import tick_label, ticks
from servescope.reports.verdict import signed_change

AXIS = (-100.0, 300.0)  # the most the axis spans, in % (or points)
TESTED = {"improved": "#1a7f37", "regressed": "#cf222e", "unchanged": "#57606a",
          "undecided": "#bf8700"}  # fmt: skip
HOLLOW = "#8c959f"  # not tested, too few samples: a change without a verdict

WIDTH, ROW, TOP, BOTTOM = 960, 30, 34, 34
NAME_W, TEXT_X = 200, 668  # the names' column; where the numbers start
PLOT = (NAME_W + 16, TEXT_X - 20)  # the plot's left and right edges, px


@dataclass(frozen=True)
class Indicator:
    """A core indicator and the metrics that measure it, the preferred first."""

    name: str
    metrics: tuple[str, ...]


INDICATORS = (
    Indicator("TTFT p50", ("ttft_ms.p50",)),
    Indicator("TPOT p50", ("tpot_ms.p50",)),
    Indicator("queue time p50", ("queue_ms.p50",)),
    Indicator("throughput", ("throughput.output_tokens_per_s",)),
    Indicator("tail latency", ("ttft_ms.p99", "ttft_ms.p95")),
    Indicator("error rate", ("error_rate",)),
    Indicator("prefix-cache hit ratio", ("server.prefix_cache_hit_ratio", "cached_token_ratio")),
)


@dataclass(frozen=True)
class Line:
    """One drawn line: a change and its interval in `unit` ("%", or "pp": points of a share)."""

    indicator: str
    metric: str
    level: str
    verdict: str
    estimate: float
    interval: tuple[float, float] | None
    unit: str
    primary: bool

    @property
    def label(self) -> str:
        """The name a reader knows, with the quantile a tail line fell back to."""
        if self.indicator == "tail latency":
            return f"tail: TTFT {self.metric.rpartition('.')[2]}"
        return self.indicator

    @property
    def numbers(self) -> str:
        """ "−54 % (−90 … +27 %)": whole percent once a change is 10 % or more."""
        values = [self.estimate, *(self.interval or ())]
        digits = 1 if self.unit == "pp" or max(abs(v) for v in values) < 10 else 0
        text = f"{signed_change(self.estimate, digits)} {self.unit}"
        if self.interval is not None:
            lo, hi = self.interval
            text += f" ({signed_change(lo, digits)} … {signed_change(hi, digits)} {self.unit})"
        return text


def _tick(value: float) -> str:
    """An axis label: signed, as many digits as the step needs (−2.5, +300)."""
    if value == 0:
        return "0"
    return ("−" if value < 0 else "+") + tick_label(abs(value))


def levels(report: Mapping[str, Any]) -> list[str]:
    """The levels a line is read at, preferred first: every level pooled, the decision's and
    the primary's level (what the headline reads), the whole run (server counters). The
    decision's own indicator is read at the decision's level first (`lines`)."""
    wanted = [STRATIFIED, (report.get("decision") or {}).get("level"),
              (report.get("primary") or {}).get("level"), WHOLE_RUN]  # fmt: skip
    return list(dict.fromkeys(level for level in wanted if level))


def _measured(row: Mapping[str, Any]) -> bool:
    """Both sides measured: a share's change is in points, so a before of 0 still draws."""
    if row.get("delta") is None:
        return False
    return is_share(row["metric"]) or row.get("delta_pct") is not None


def _pick(rows: Sequence[Mapping[str, Any]], metrics: Sequence[str], order: list[str]) -> Any:
    """The row an indicator is drawn from: for each of its metrics, the row at the first level
    of `order` that measured it (else at the first level that did); of those, the first that
    was tested (a tail's p99 with too few samples gives way to a tested p95), else the first
    measured; None when none was."""
    found = []
    for metric in metrics:
        at = {r["level"]: r for r in rows if r["metric"] == metric and _measured(r)}
        row = next((at[level] for level in order if level in at), next(iter(at.values()), None))
        if row is not None:
            found.append(row)
    return next((r for r in found if r["verdict"] in TESTED), found[0] if found else None)


def _line(indicator: Indicator, row: Mapping[str, Any], decision: Mapping[str, Any]) -> Line:
    """A row as a line; the decision's own reading when the row is the decision's (the first
    screen and the plot then say the same)."""
    share = is_share(row["metric"])
    if share:  # points: the change of the share × 100
        estimate = float(row["delta"]) * 100
        ci = row.get("ci95")
        interval = (ci[0] * 100, ci[1] * 100) if ci else None
    else:
        estimate = float(row["delta_pct"])
        ci = row.get("ci95_pct")
        interval = (float(ci[0]), float(ci[1])) if ci else None
    line = Line(indicator.name, row["metric"], row["level"], row["verdict"], estimate, interval,
                "pp" if share else "%", row.get("role") == "primary")  # fmt: skip
    if decision.get("metric") != row["metric"] or decision.get("level") != row["level"]:
        return line
    if share:
        got = decision.get("interval")
        interval = (got[0] * 100, got[1] * 100) if got else None
    else:
        got = decision.get("interval_pct")
        interval = (float(got[0]), float(got[1])) if got else None
        if decision.get("estimate_pct") is not None:
            estimate = float(decision["estimate_pct"])
    return replace(line, verdict=decision.get("verdict") or line.verdict, estimate=estimate,
                   interval=interval, primary=True)  # fmt: skip


def lines(report: Mapping[str, Any]) -> list[Line]:
    """The core indicators the report measured, in INDICATORS' order."""
    rows = report.get("diff") or []
    order = levels(report)
    decision = report.get("decision") or {}
    out = []
    for indicator in INDICATORS:
        first = [decision["level"]] if decision.get("metric") in indicator.metrics else []
        row = _pick(rows, indicator.metrics, list(dict.fromkeys(first + order)))
        if row is not None:
            out.append(_line(indicator, row, decision))
    return out


def unmeasured(report: Mapping[str, Any]) -> list[str]:
    """The core indicators the plot leaves out because neither side measured them."""
    drawn = {line.indicator for line in lines(report)}
    return [i.name for i in INDICATORS if i.name not in drawn]


def margin_of(report: Mapping[str, Any]) -> float:
    """The ±margin within which a change counts as none: the decision's, else the default."""
    margin = (report.get("decision") or {}).get("margin_pct")
    return MARGIN_PCT if margin is None else float(margin)


def _axis(drawn: Sequence[Line], margin: float) -> tuple[float, float]:
    """The axis's range: every change, interval and the margin, cut to AXIS, a little padded."""
    values = [0.0, -margin, margin]
    for line in drawn:
        values += [line.estimate, *(line.interval or ())]
    finite = [v for v in values if math.isfinite(v)]
    lo, hi = max(min(finite), AXIS[0]), min(max(finite), AXIS[1])
    pad = (hi - lo) * 0.04
    return max(lo - pad, AXIS[0]), min(hi + pad, AXIS[1])


def _arrow(x: float, y: float, right: bool, colour: str) -> str:
    """A head at an axis edge: the interval (or the change) goes on beyond it."""
    tip, back = (x, x - 7) if right else (x, x + 7)
    return (f'<polygon class="arrow" points="{tip:.1f},{y:.1f} {back:.1f},{y - 4:.1f} '
            f'{back:.1f},{y + 4:.1f}" fill="{colour}"/>')  # fmt: skip


def main_level(report: Mapping[str, Any]) -> str | None:
    """The level most lines are read at, which the caption names once; None without lines."""
    found = [line.level for line in lines(report)]
    return max(dict.fromkeys(found), key=found.count) if found else None


def _draw(line: Line, y: float, px: Any, lo: float, hi: float, common: str | None) -> list[str]:
    """One line's bar, arrows and dot, its name (and its level, where not the common one) and
    its numbers."""
    tested = line.verdict in TESTED
    colour = TESTED.get(line.verdict, HOLLOW)
    level = "" if line.level == common else line.level
    out = [
        f'<g class="line" data-indicator="{escape(line.indicator)}" '
        f'data-verdict="{escape(line.verdict)}">',
        f"<title>{escape(f'{line.metric} at {line.level}: {line.verdict}')}</title>",
        f'<text x="8" y="{y + 4:.1f}" font-size="12"'
        + (' font-weight="600"' if line.primary else "")
        + f">{escape(line.label)}</text>",
    ]
    if level:
        out.append(f'<text x="8" y="{y + 15:.1f}" font-size="9" fill="#57606a">'
                   f"{escape(level)}</text>")  # fmt: skip
    if line.interval is not None:
        a, b = sorted(line.interval)
        x1, x2 = px(max(a, lo)), px(min(b, hi))
        dash = "" if tested else ' stroke-dasharray="3 2"'
        out.append(f'<line x1="{x1:.1f}" x2="{x2:.1f}" y1="{y:.1f}" y2="{y:.1f}" '
                   f'stroke="{colour}" stroke-width="2.5"{dash}/>')  # fmt: skip
        if a < lo:
            out.append(_arrow(px(lo), y, False, colour))
        if b > hi:
            out.append(_arrow(px(hi), y, True, colour))
    if lo <= line.estimate <= hi:
        fill = colour if tested else "#ffffff"
        out.append(f'<circle cx="{px(line.estimate):.1f}" cy="{y:.1f}" r="5" fill="{fill}" '
                   f'stroke="{colour}" stroke-width="1.8"/>')  # fmt: skip
    else:
        out.append(_arrow(px(hi if line.estimate > hi else lo), y, line.estimate > hi, colour))
    weight = ' font-weight="600"' if tested and line.verdict != "unchanged" else ""
    out.append(f'<text x="{TEXT_X}" y="{y + 4:.1f}" font-size="12">{escape(line.numbers)} '
               f'<tspan fill="{colour}"{weight}>{escape(line.verdict)}</tspan></text>')  # fmt: skip
    out.append("</g>")
    return out


def forest_svg(report: Mapping[str, Any]) -> Markup:
    """The plot as inline SVG (class "forest"); empty when the report measured none of the
    core indicators (or is a single run's)."""
    drawn = lines(report)
    if not drawn:
        return Markup("")
    margin = margin_of(report)
    lo, hi = _axis(drawn, margin)
    left, right = PLOT
    height = TOP + ROW * len(drawn) + BOTTOM

    def px(value: float) -> float:
        return left + (value - lo) / (hi - lo) * (right - left)

    title = "Change after vs before: Δ % (pp for shares) with the interval its verdict reads"
    bottom = TOP + ROW * len(drawn)
    out = [
        f'<svg class="forest" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {height}" '
        f'width="{WIDTH}" height="{height}" role="img" aria-label="{escape(title)}">',
        f"<title>{escape(title)}</title>",
        f'<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="#ffffff"/>',
        f'<rect class="margin" x="{px(max(-margin, lo)):.1f}" y="{TOP - 6}" '
        f'width="{px(min(margin, hi)) - px(max(-margin, lo)):.1f}" '
        f'height="{bottom - TOP + 12}" fill="#eaeef2"/>',
        f'<text x="{px(0):.1f}" y="{TOP - 12}" font-size="10" text-anchor="middle" '
        f'fill="#57606a">{escape(f"±{margin:g} %: no change that matters")}</text>',
    ]
    for t in ticks(lo, hi):
        out.append(
            f'<line x1="{px(t):.1f}" x2="{px(t):.1f}" y1="{TOP - 6}" y2="{bottom + 6}" '
            f'stroke="#d0d7de" stroke-width="0.5"/>'
            f'<text x="{px(t):.1f}" y="{bottom + 20}" font-size="10" text-anchor="middle">'
            f"{escape(_tick(t))}</text>"
        )
    out.append(
        f'<line x1="{px(0):.1f}" x2="{px(0):.1f}" y1="{TOP - 6}" y2="{bottom + 6}" '
        f'stroke="#24292f" stroke-width="1.2"/>'
        f'<text x="8" y="{TOP - 12}" font-size="10" fill="#57606a">'
        "Δ in % of before (shares: pp)</text>"
    )
    common = main_level(report)
    for i, line in enumerate(drawn):
        out += _draw(line, TOP + ROW * i + ROW / 2 - 4, px, lo, hi, common)
    out.append("</svg>")
    return Markup("\n".join(out))
