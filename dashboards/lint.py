"""Checks every built dashboard must pass before it is written (and that tests run): each panel
has a title, a description, a valid unit and the `datasource` variable; every PromQL expression
parses once Grafana's macros are substituted; counters appear only under `rate()`/`increase()`;
every range is `$__rate_interval`; exactly one datasource variable.

Works on the dashboard JSON (what Grafana loads), not on grafanalib objects, so it also checks
a dashboard edited by hand.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import promql_parser

from servescope.dashboards.panels import VALID_UNITS

COUNTER_SUFFIXES = ("_total", "_bucket", "_count", "_sum")
RATE_FUNCTIONS = {"rate", "increase"}
CUSTOM_UNIT = re.compile(r"^(suffix|prefix|si|count):.+$")
VARIABLE = re.compile(r"\$\{?(\w+)\}?")
# Lint substitutes an odd duration for $__rate_interval so a hard-coded range cannot pass.
LINT_RATE_INTERVAL = "1m7s"
LINT_RATE_SECONDS = timedelta(seconds=67)


@dataclass(frozen=True)
class PanelQuery:
    """One PromQL expression of a dashboard: a panel target or an annotation query."""

    dashboard: str
    panel: str
    ref: str
    expr: str

    @property
    def where(self) -> str:
        return f"{self.dashboard} / {self.panel!r} / {self.ref}"


def substitute(expr: str, rate_interval: str = "1m", interval: str = "15s") -> str:
    """Grafana's macros and variables as Grafana would send them: `$__rate_interval` and
    `$__interval` become durations, `$__range` the range, any dashboard variable `.*` (the
    "All" value; every variable is used with `=~`)."""
    macros = {
        "__rate_interval": rate_interval,
        "__interval": interval,
        "__range": "1h",
        "__range_s": "3600",
    }
    return VARIABLE.sub(lambda m: macros.get(m.group(1), ".*"), expr)


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel that shows data (rows skipped, panels inside collapsed rows included)."""
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def queries(dashboard: dict[str, Any]) -> list[PanelQuery]:
    """Panel targets, in panel order."""
    title = dashboard.get("title", "?")
    return [
        PanelQuery(title, panel.get("title", "?"), target.get("refId", "?"), target["expr"])
        for panel in panels(dashboard)
        for target in panel.get("targets", [])
        if target.get("expr")
    ]


def annotation_queries(dashboard: dict[str, Any]) -> list[PanelQuery]:
    title = dashboard.get("title", "?")
    return [
        PanelQuery(title, f"annotation {a.get('name')}", "-", a["expr"])
        for a in dashboard.get("annotations", {}).get("list", [])
        if a.get("expr")
    ]


def parse(expr: str, rate_interval: str = "1m") -> promql_parser.Expr:
    """Parse after substitution; raises ValueError with the parser's message."""
    return promql_parser.parse(substitute(expr, rate_interval))


def _children(node: Any) -> list[Any]:
    if isinstance(node, promql_parser.BinaryExpr):
        return [node.lhs, node.rhs]
    if isinstance(node, promql_parser.AggregateExpr):
        return [c for c in (node.expr, node.param) if c is not None]
    if isinstance(node, promql_parser.Call):
        return list(node.args)
    if isinstance(node, promql_parser.MatrixSelector):
        return [node.vector_selector]
    if isinstance(node, promql_parser.ParenExpr | promql_parser.UnaryExpr):
        return [node.expr]
    if isinstance(node, promql_parser.SubqueryExpr):
        return [node.expr]
    return []


def expression_problems(query: PanelQuery, *, require_rate_interval: bool = True) -> list[str]:
    """Why this expression is wrong, or nothing. Counters (`*_total`, histogram series) must sit
    under rate()/increase(): a raw counter only ever grows and says nothing about the window."""
    try:
        tree = parse(query.expr, LINT_RATE_INTERVAL)
    except ValueError as exc:
        return [f"{query.where}: does not parse: {exc}"]
    problems: list[str] = []

    def visit(node: Any, under_rate: bool) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            name = node.name or ""
            if name.endswith(COUNTER_SUFFIXES) and not under_rate:
                problems.append(f"{query.where}: counter {name} outside rate()/increase()")
        if (
            require_rate_interval
            and isinstance(node, promql_parser.MatrixSelector)
            and node.range != LINT_RATE_SECONDS
        ):
            problems.append(f"{query.where}: range [{node.range}] is not [$__rate_interval]")
        if isinstance(node, promql_parser.Call):
            under_rate = node.func.name in RATE_FUNCTIONS
        for child in _children(node):
            visit(child, under_rate)

    visit(tree, False)
    return problems


def _unit(panel: dict[str, Any]) -> str | None:
    return panel.get("fieldConfig", {}).get("defaults", {}).get("unit")


def panel_problems(dashboard: dict[str, Any], panel: dict[str, Any]) -> list[str]:
    where = f"{dashboard.get('title', '?')} / {panel.get('title') or 'untitled panel'!r}"
    problems = []
    if not panel.get("title"):
        problems.append(f"{where}: no title")
    if not (panel.get("description") or "").strip():
        problems.append(f"{where}: no description (say what a bad value means)")
    unit = _unit(panel)
    if not unit:
        problems.append(f"{where}: no unit")
    elif unit not in VALID_UNITS and not CUSTOM_UNIT.match(unit):
        problems.append(f"{where}: unit {unit!r} is not a Grafana unit")
    if not panel.get("targets"):
        problems.append(f"{where}: no query")
    sources = [panel.get("datasource"), *(t.get("datasource") for t in panel.get("targets", []))]
    if any((s or {}).get("uid") != "${datasource}" for s in sources):
        problems.append(f"{where}: datasource is not the $datasource variable")
    return problems


def lint(dashboard: dict[str, Any]) -> list[str]:
    """Every problem of one dashboard JSON; an empty list means it is fit to ship."""
    title = dashboard.get("title", "?")
    problems: list[str] = []
    variables = dashboard.get("templating", {}).get("list", [])
    datasource_vars = [v for v in variables if v.get("type") == "datasource"]
    if len(datasource_vars) != 1 or datasource_vars[0].get("name") != "datasource":
        problems.append(f"{title}: needs exactly one datasource variable named `datasource`")
    for panel in panels(dashboard):
        problems += panel_problems(dashboard, panel)
    for query in queries(dashboard):
        problems += expression_problems(query)
    for query in annotation_queries(dashboard):
        problems += expression_problems(query, require_rate_interval=False)
    return problems
