"""`report build RUN` (also `servescope report build RUN`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from reports.render import DEFAULT_OUT, FORMATS, write_report
from reports.summary import UnknownRun, run_summary
from servescope.commands.common import add_store_option, console, open_store

DESCRIPTION = "Render stored runs as self-contained HTML, Markdown and JSON reports."


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("report", help="build run reports", description=DESCRIPTION)
    add_subcommands(parser)


def add_subcommands(parser: argparse.ArgumentParser) -> None:
    reports = parser.add_subparsers(dest="report_command", required=True, metavar="SUBCOMMAND")
    build = reports.add_parser(
        "build",
        help="write DIR/RUN/index.html, report.md and report.json",
        description="Summarise one run: requests, errors, error rate, TTFT/TPOT/e2e/queue "
        "percentiles, throughput and prefix-cache hits, overall and per workload level. "
        "Exits 2 for an unknown run.",
    )
    build.add_argument("run_id", metavar="RUN")
    build.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"(default {DEFAULT_OUT})")
    build.add_argument(
        "--format", default=",".join(FORMATS), help=f"comma-separated subset of {','.join(FORMATS)}"
    )
    add_store_option(build)
    build.set_defaults(func=run_build)


def run_build(args: argparse.Namespace) -> int:
    formats = tuple(f.strip() for f in args.format.split(",") if f.strip())
    if bad := [f for f in formats if f not in FORMATS]:
        console.print(f"[red]unknown format {bad}; choose from {FORMATS}")
        return 2
    try:
        report = run_summary(open_store(args), args.run_id)
    except UnknownRun as exc:
        console.print(f"[red]{exc}")
        return 2
    for path in write_report(report, args.out, formats):
        print(path)
    return 0
