"""The report's pictures: latency CDFs (before vs after), TTFT over time with lever-flip
markers, and TTFT p95 and throughput against the load level (concurrency or request rate)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

import numpy as np

from servescope.reports.indicators import Side
from servescope.reports.svg import TIME_BUCKETS, Marker, Series, chart

CDF_METRICS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "end-to-end latency"))


def _cdfs(sides: list[Side]) -> dict[str, str]:
    out = {}
    for metric, title in CDF_METRICS:
        series = [replace(s.samples.successful(metric).cdf, label=s.name) for s in sides]
        if svg := chart(
            f"{title}: cumulative distribution", series, x_label="ms", y_label="share of requests"
        ):
            out[f"cdf_{metric}"] = svg
    return out


class Timeline:
    """Seconds since the first request, with long idle gaps between the sides folded away.

    Two runs of an experiment are minutes apart (a vLLM restart between them); drawn on one
    clock, each would be a sliver at an edge. A gap longer than `GAP_SHARE` of the measured
    time is drawn as that share, and the axis label says how much was left out."""

    GAP_SHARE = 0.05

    def __init__(self, spans: list[tuple[float, float]]) -> None:
        """`spans`: each side's first and last request start (epoch seconds)."""
        spans = sorted(spans)
        self.origin = spans[0][0] if spans else 0.0
        measured = sum(end - start for start, end in spans)
        self.pad = max(self.GAP_SHARE * measured, 1.0)
        self.cuts: list[tuple[float, float, float]] = []  # (gap start, gap end, cut so far)
        self.folded = 0.0
        end = spans[0][1] if spans else 0.0
        for start, stop in spans[1:]:
            if start - end > self.pad:
                self.folded += start - end - self.pad
                self.cuts.append((end, start, self.folded))
            end = max(end, stop)

    def x(self, t: float) -> float:
        return float(self.xs(np.array([t], dtype=float))[0])

    def xs(self, t: np.ndarray) -> np.ndarray:
        """Drawn positions of times `t`, vectorised: a run has up to millions of requests."""
        drawn = t - self.origin
        cut_before = 0.0
        for gap_start, gap_end, total in self.cuts:
            after = t >= gap_end
            drawn[after] = t[after] - total - self.origin
            inside = (t > gap_start) & ~after  # squeezed into the gap's drawn width
            share = (t[inside] - gap_start) / (gap_end - gap_start)
            drawn[inside] = gap_start - cut_before + share * self.pad - self.origin
            cut_before = total
        return drawn

    @property
    def label(self) -> str:
        if not self.folded:
            return "seconds since the first request"
        return f"seconds of measurement ({self.folded:,.0f} s between the runs not drawn)"


def _over_time(sides: list[Side], flips: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    spans = [span for s in sides if (span := s.samples.span) is not None]
    if not spans:
        return {}
    clock = Timeline(spans)
    drawn = []
    dots = True
    for side in sides:
        t, ttft, width = side.samples.ttft_over_time(TIME_BUCKETS)
        label = side.name if width is None else f"{side.name} (median per {width:.2g} s)"
        drawn.append(Series(label, clock.xs(t), ttft))
        dots = dots and width is None
    markers = [
        Marker(clock.x(float(f["t"])), f"{f['lever']}: {f['before']} → {f['after']}")
        for f in flips
        if f.get("t") is not None
    ]
    svg = chart(
        "TTFT over time",
        drawn,
        x_label=clock.label,
        y_label="TTFT (ms)",
        markers=markers,
        dots=dots,
    )
    return {"ttft_over_time": svg} if svg else {}


def _by_level(sides: list[Side]) -> dict[str, str]:
    out: dict[str, str] = {}
    axes: tuple[tuple[Literal["concurrency", "target_rate"], str], ...] = (
        ("concurrency", "concurrency"),
        ("target_rate", "target rate (req/s)"),
    )
    for key, axis in axes:
        ttft, tput = [], []
        for side in sides:
            workloads = sorted({g["workload"] or "" for g in side.summary["groups"]})
            for workload in workloads:
                rows = sorted(
                    (
                        g
                        for g in side.summary["groups"]
                        if (g["workload"] or "") == workload and g[key] is not None
                    ),
                    key=lambda g: float(g[key] or 0.0),
                )
                if len(rows) < 2:
                    continue
                label = f"{side.name} · {workload}" if workload else side.name
                xs = np.array([float(g[key] or 0.0) for g in rows])
                p95 = [g["ttft_ms"]["p95"] for g in rows]
                tok = [g["throughput"]["output_tokens_per_s"] for g in rows]
                ttft.append(Series(label, xs, np.array(p95, dtype=float)))
                tput.append(Series(label, xs, np.array(tok, dtype=float)))
        if svg := chart(f"TTFT p95 vs {axis}", ttft, x_label=axis, y_label="TTFT p95 (ms)"):
            out[f"ttft_vs_{key}"] = svg
        if svg := chart(
            f"Output throughput vs {axis}", tput, x_label=axis, y_label="output tokens/s"
        ):
            out[f"throughput_vs_{key}"] = svg
    return out


def charts(sides: list[Side], flips: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """SVG documents by name, in the order the report shows them."""
    return {**_cdfs(sides), **_over_time(sides, flips), **_by_level(sides)}
