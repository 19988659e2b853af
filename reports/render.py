"""Render a report dict to HTML (one self-contained file), Markdown and JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined

DEFAULT_OUT = Path("servescope-data") / "reports"
FORMATS = ("html", "md", "json")
FILENAMES = {"html": "index.html", "md": "report.md", "json": "report.json"}


def fmt(value: Any, digits: int = 1) -> str:
    """Numbers for people: None is 'n/a', never 0."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.1f} %"


def _environment(autoescape: bool) -> Environment:
    env = Environment(
        loader=PackageLoader("reports", "templates"),
        autoescape=autoescape,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["fmt"] = fmt
    env.filters["pct"] = pct
    return env


def render(report: dict[str, Any], fmt_name: str) -> str:
    if fmt_name == "json":
        return json.dumps(report, indent=2, default=str) + "\n"
    template = _environment(fmt_name == "html").get_template(f"report.{fmt_name}.j2")
    return template.render(r=report, metrics=("ttft_ms", "tpot_ms", "e2e_ms", "queue_ms"))


def write_report(
    report: dict[str, Any], out: Path = DEFAULT_OUT, formats: tuple[str, ...] = FORMATS
) -> list[Path]:
    """Write `out/<run_id>/{index.html,report.md,report.json}`; returns the paths written."""
    folder = out / report["run_id"]
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in formats:
        path = folder / FILENAMES[name]
        path.write_text(render(report, name), encoding="utf-8")
        paths.append(path)
    return paths
