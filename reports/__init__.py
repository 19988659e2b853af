"""Run reports: one run's summary, or a before/after diff of two runs (or of one run split at
its lever flip), rendered to self-contained HTML, Markdown and JSON.

    report = build_diff(Store(), "run-b", "run-a")
    write_report(report, settings.reports_dir(), ("html", "md", "json"))
"""

from servescope.reports.build import (
    NoLeverFlip,
    NoPreviousRun,
    build_diff,
    build_split,
    build_summary,
)
from servescope.reports.prometheus import PrometheusUnavailable
from servescope.reports.render import FORMATS, render, write_report
from servescope.reports.replicas import NotAFleet
from servescope.reports.summary import ReportOptions, UnknownRun
from servescope.reports.windows import BadWindow, Window

__all__ = [
    "BadWindow",
    "FORMATS",
    "NoLeverFlip",
    "NoPreviousRun",
    "NotAFleet",
    "PrometheusUnavailable",
    "ReportOptions",
    "UnknownRun",
    "Window",
    "build_diff",
    "build_split",
    "build_summary",
    "render",
    "write_report",
]
