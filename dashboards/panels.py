"""Building blocks every servescope dashboard shares: the datasource variable, panel factories
that force a title, a description of what a bad value means and a unit, histogram quantiles
over `$__rate_interval`, and the lever-flip annotations.

Panels take their datasource from the `datasource` variable, so one dashboard works against any
Prometheus; the variable preselects the provisioned one (uid `DATASOURCE_UID`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from grafanalib import formatunits as units
from grafanalib.core import (
    Annotations,
    Dashboard,
    GridPos,
    Heatmap,
    RowPanel,
    Target,
    Template,
    Templating,
    TimeSeries,
)

DATASOURCE_UID = "prometheus"  # the provisioned Prometheus; the variable preselects it
DATASOURCE: dict[str, str] = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
TOKENS_PER_SECOND = "suffix: tok/s"
PANEL_HEIGHT = 8
GRID_WIDTH = 24

# Flips recorded by the collector: one info series per (lever, before, after), its value the
# flip's unix time. A flip shows when its series first appears, or when the value changes (the
# same flip happening again).
LEVER_FLIP_EXPR = (
    "max by (lever, before, after) ("
    "(servescope_lever_flip_info unless servescope_lever_flip_info offset 1m)"
    " or (changes(servescope_lever_flip_info[1m]) > 0))"
)
LEVER_FLIP_TAG = "lever-flip"


def datasource_variable() -> Template:
    return Template(
        name="datasource",
        label="Prometheus",
        type="datasource",
        query="prometheus",
        default=DATASOURCE_UID,
    )


def label_variable(name: str, metric: str, label: str) -> Template:
    """A multi-value variable over one label's values; 'All' matches everything (`.*`)."""
    return Template(
        name=name,
        label=label,
        query=f"label_values({metric}, {name})",
        dataSource=DATASOURCE,
        multi=True,
        includeAll=True,
        allValue=".*",
        default="$__all",
        refresh=2,
    )


def lever_flip_annotations() -> Annotations:
    """Two sources, shown on every time-series panel: the collector's flip series, and Grafana
    annotations tagged `lever-flip` (posted by a person or a script through Grafana's API)."""
    return Annotations(
        [
            {
                "name": "Lever flips (collector)",
                "datasource": DATASOURCE,
                "enable": True,
                "iconColor": "orange",
                "expr": LEVER_FLIP_EXPR,
                "step": "15s",
                "titleFormat": "lever flip: {{lever}}",
                "textFormat": "{{lever}}: {{before}} → {{after}}",
                "tagKeys": "lever",
                "useValueForTime": False,
            },
            {
                "name": "Lever flips (tagged)",
                "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                "enable": True,
                "iconColor": "purple",
                "target": {
                    "type": "tags",
                    "tags": [LEVER_FLIP_TAG],
                    "matchAny": True,
                    "limit": 100,
                },
            },
        ]
    )


def target(expr: str, legend: str, ref: str = "A", *, heatmap: bool = False) -> Target:
    return Target(
        expr=expr,
        legendFormat=legend,
        refId=ref,
        datasource=DATASOURCE,
        format="heatmap" if heatmap else "time_series",
        intervalFactor=1,
    )


def quantile(q: float, bucket: str, by: str, selector: str = "") -> str:
    """`histogram_quantile` over a rate of `bucket`; when the rank falls in `+Inf` Prometheus
    returns the top finite bound, so a flat line at a bucket edge means "at least this"."""
    return f"histogram_quantile({q}, sum by (le, {by}) (rate({bucket}{{{selector}}}[{RATE}])))"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


def timeseries(
    title: str,
    bad: str,
    unit: str,
    queries: Sequence[Query],
    *,
    width: int = 12,
    stacked: bool = False,
    max_value: float | None = None,
) -> TimeSeries:
    """A time-series panel; `bad` is the description, and must say what a bad value means."""
    return TimeSeries(
        title=title,
        description=bad,
        dataSource=DATASOURCE,
        targets=[target(q.expr, q.legend, chr(ord("A") + i)) for i, q in enumerate(queries)],
        unit=unit,
        gridPos=GridPos(h=PANEL_HEIGHT, w=width, x=0, y=0),
        legendDisplayMode="table",
        legendCalcs=["mean", "max", "lastNotNull"],
        tooltipMode="multi",
        stacking={"mode": "normal", "group": "A"} if stacked else {"mode": "none"},
        fillOpacity=30 if stacked else 10,
        valueMax=max_value,
        maxDataPoints=None,  # grafanalib's 100 would coarsen the step; Grafana uses the width
    )


def heatmap(title: str, bad: str, unit: str, expr: str, *, width: int = 12) -> Heatmap:
    """A heatmap of a Prometheus histogram: per-bucket increases, buckets by upper bound."""
    return Heatmap(
        title=title,
        description=bad,
        dataSource=DATASOURCE,
        targets=[target(expr, "{{le}}", heatmap=True)],
        dataFormat="tsbuckets",
        yBucketBound="upper",
        hideZeroBuckets=True,
        maxDataPoints=None,
        gridPos=GridPos(h=PANEL_HEIGHT, w=width, x=0, y=0),
        extraJson={
            "fieldConfig": {"defaults": {"unit": unit}},
            "yAxis": {"format": unit},
            "options": {"calculate": False, "yAxis": {"unit": unit}},
        },
    )


def row(title: str) -> RowPanel:
    return RowPanel(title=title, gridPos=GridPos(h=1, w=GRID_WIDTH, x=0, y=0))


def layout(panels: Sequence[Any]) -> list[Any]:
    """Place panels left to right, wrapping at the grid width; a row starts a new line."""
    x = y = line_height = 0
    for panel in panels:
        pos: GridPos = panel.gridPos
        if isinstance(panel, RowPanel) or x + pos.w > GRID_WIDTH:
            x, y, line_height = 0, y + line_height, 0
        pos.x, pos.y = x, y
        if isinstance(panel, RowPanel):
            y, line_height = y + pos.h, 0
        else:
            x, line_height = x + pos.w, max(line_height, pos.h)
    return list(panels)


def dashboard(
    uid: str,
    title: str,
    description: str,
    panels: Sequence[Any],
    variables: Sequence[Template] = (),
) -> Dashboard:
    return Dashboard(
        uid=uid,
        title=title,
        description=description,
        tags=["servescope", "vllm"],
        timezone="utc",
        refresh="10s",
        graphTooltip=1,
        panels=layout(panels),
        templating=Templating([datasource_variable(), *variables]),
        annotations=lever_flip_annotations(),
    ).auto_panel_ids()


VALID_UNITS: frozenset[str] = frozenset(
    value for name, value in vars(units).items() if name.isupper() and isinstance(value, str)
)
"""Grafana's unit ids (grafanalib's copy of Grafana's `valueFormats/categories.ts`)."""
