"""Inline SVG charts: the HTML report stays one file that opens offline, with no script at all.

Every piece of text that reaches the SVG (run ids, workload names, lever values) is escaped here;
the templates mark the result safe. Large runs are reduced before drawing (quantile points for
CDFs, per-bucket medians over time: `reports.samples`), so a chart is a few kilobytes whatever
the request count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

import numpy as np

from servescope.reports.bootstrap import Floats

WIDTH, HEIGHT = 640, 300
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 28, 62
COLOURS = ("#0969da", "#cf222e", "#1a7f37", "#8250df", "#bf8700", "#57606a")
CDF_POINTS = 200
TIME_BUCKETS = 240
LEGEND_ROW, LEGEND_CHAR = 14, 6  # px per legend row; px per character at font-size 10


@dataclass
class Series:
    label: str
    x: Floats
    y: Floats


@dataclass
class Marker:
    x: float
    label: str


def ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round axis values (steps of 1, 2, 2.5 or 5 times a power of ten) from
    `lo` to `hi`: the charts' and the forest plot's axes."""
    if not math.isfinite(lo) or not math.isfinite(hi) or hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def tick_label(value: float) -> str:
    """An axis value as short as it reads: 0, 1,250, 12.5, 0.0125."""
    if value == 0:
        return "0"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}"


@dataclass(frozen=True)
class _Frame:
    """The plot's data ranges and the pixels they map to."""

    x0: float
    x1: float
    y0: float
    y1: float
    plot_w: float = WIDTH - LEFT - RIGHT
    plot_h: float = HEIGHT - TOP - BOTTOM

    @classmethod
    def around(cls, drawn: Sequence[Series], markers: Sequence[Marker]) -> _Frame:
        """Every point and marker inside, y from 0 (or below) with 5 % headroom."""
        xs = np.concatenate([s.x for s in drawn] + [np.array([m.x for m in markers], float)])
        ys = np.concatenate([s.y for s in drawn])
        x0, x1 = float(np.nanmin(xs)), float(np.nanmax(xs))
        y0, y1 = min(0.0, float(np.nanmin(ys))), float(np.nanmax(ys))
        if x1 <= x0:
            x0, x1 = x0 - 1, x1 + 1
        if y1 <= y0:
            y1 = y0 + 1
        return cls(x0, x1, y0, y1 * 1.05)

    def px(self, x: float) -> float:
        return LEFT + (x - self.x0) / (self.x1 - self.x0) * self.plot_w

    def py(self, y: float) -> float:
        return TOP + self.plot_h - (y - self.y0) / (self.y1 - self.y0) * self.plot_h


def chart(
    title: str,
    series: Sequence[Series],
    *,
    x_label: str,
    y_label: str,
    markers: Sequence[Marker] = (),
    dots: bool = False,
) -> str:
    """A line (or dot) chart with axes, a legend and vertical markers; '' when there is no data."""
    drawn = [s for s in series if len(s.x)]
    if not drawn:
        return ""
    frame = _Frame.around(drawn, markers)
    legend = _legend_places([s.label for s in drawn])
    height = HEIGHT + LEGEND_ROW * max(y for _x, y in legend)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {height}" '
        f'width="{WIDTH}" height="{height}" role="img" aria-label="{escape(title)}">',
        f"<title>{escape(title)}</title>",
        f'<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="#ffffff"/>',
        f'<text x="{LEFT}" y="18" font-size="13" font-weight="600">{escape(title)}</text>',
        *_axes(frame, x_label, y_label),
        *_markers(frame, markers),
        *_series(frame, drawn, legend, dots),
        "</svg>",
    ]
    return "\n".join(out)


def _axes(frame: _Frame, x_label: str, y_label: str) -> list[str]:
    """Grid lines with the y ticks, the x ticks, both axes and their labels."""
    px, py, plot_w, plot_h = frame.px, frame.py, frame.plot_w, frame.plot_h
    out = [
        f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{py(t):.1f}" y2="{py(t):.1f}" '
        f'stroke="#d0d7de" stroke-width="0.5"/>'
        f'<text x="{LEFT - 6}" y="{py(t) + 4:.1f}" font-size="10" text-anchor="end">'
        f"{tick_label(t)}</text>"
        for t in ticks(frame.y0, frame.y1)
    ]
    out += [
        f'<text x="{px(t):.1f}" y="{TOP + plot_h + 14}" font-size="10" '
        f'text-anchor="middle">{tick_label(t)}</text>'
        for t in ticks(frame.x0, frame.x1)
    ]
    out.append(
        f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{TOP + plot_h}" y2="{TOP + plot_h}" '
        f'stroke="#57606a"/><line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{TOP + plot_h}" '
        f'stroke="#57606a"/>'
        f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 26}" font-size="11" text-anchor="middle">'
        f"{escape(x_label)}</text>"
        f'<text x="12" y="{TOP + plot_h / 2}" font-size="11" text-anchor="middle" '
        f'transform="rotate(-90 12 {TOP + plot_h / 2})">{escape(y_label)}</text>'
    )
    return out


def _markers(frame: _Frame, markers: Sequence[Marker]) -> list[str]:
    out: list[str] = []
    for marker in markers:
        x = frame.px(marker.x)
        # labels of markers in the right half read leftwards, so they stay inside the picture
        tx, anchor = (x + 3, "start") if x < LEFT + frame.plot_w / 2 else (x - 3, "end")
        out.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{TOP + frame.plot_h}" '
            f'stroke="#bf8700" stroke-dasharray="4 3"/><text x="{tx:.1f}" y="{TOP + 10}" '
            f'font-size="10" text-anchor="{anchor}" fill="#9a6700">{escape(marker.label)}</text>'
        )
    return out


def _series(
    frame: _Frame, drawn: Sequence[Series], legend: list[tuple[int, int]], dots: bool
) -> list[str]:
    """Each series as a line (or dots) in its colour, and its legend entry."""
    out: list[str] = []
    for i, (s, (lx, row)) in enumerate(zip(drawn, legend, strict=True)):
        colour = COLOURS[i % len(COLOURS)]
        keep = ~(np.isnan(s.x) | np.isnan(s.y))
        points = [
            (frame.px(float(x)), frame.py(float(y)))
            for x, y in zip(s.x[keep], s.y[keep], strict=True)
        ]
        if dots:
            out.extend(
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="1.8" fill="{colour}"/>' for x, y in points
            )
        else:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
            out.append(
                f'<polyline fill="none" stroke="{colour}" stroke-width="1.6" points="{path}"/>'
            )
        ly = HEIGHT + LEGEND_ROW * row
        out.append(
            f'<rect x="{lx}" y="{ly - 16}" width="10" height="10" fill="{colour}"/>'
            f'<text x="{lx + 14}" y="{ly - 7}" font-size="10">{escape(s.label)}</text>'
        )
    return out


def _legend_places(labels: Sequence[str]) -> list[tuple[int, int]]:
    """(x, row) of each legend entry: side by side while they fit, else on a new row (run ids
    are long; a legend cut off at the edge names no run)."""
    places, x, row = [], LEFT, 0
    for label in labels:
        width = 24 + LEGEND_CHAR * len(label)
        if x > LEFT and x + width > WIDTH:
            x, row = LEFT, row + 1
        places.append((x, row))
        x += width
    return places


def cdf_series(label: str, sorted_values: Floats) -> Series:
    """An empirical CDF reduced to at most CDF_POINTS quantile points."""
    n = len(sorted_values)
    if n == 0:
        return Series(label, np.zeros(0), np.zeros(0))
    if n <= CDF_POINTS:
        return Series(label, sorted_values, np.arange(1, n + 1) / n)
    probs = np.linspace(0, 1, CDF_POINTS)
    rank = probs * (n - 1)  # linear interpolation between closest ranks, on sorted values
    low = np.floor(rank).astype(np.int64)
    high = np.minimum(low + 1, n - 1)
    xs = sorted_values[low] + (rank - low) * (sorted_values[high] - sorted_values[low])
    return Series(label, xs, probs)
