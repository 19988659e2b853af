"""`report build RUN [--vs BASE | --split-at-flip]` and `report list` (also `servescope report`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from servescope.commands.common import (
    add_lake_option,
    add_store_option,
    add_window_options,
    console,
    list_runs,
    open_store,
    rows,
    run_arg,
)
from servescope.reports import (
    DEFAULT_OUT,
    FORMATS,
    BadWindow,
    NoLeverFlip,
    NoPreviousRun,
    NotAFleet,
    PrometheusUnavailable,
    ReportOptions,
    UnknownRun,
    Window,
    build_diff,
    build_split,
    build_summary,
    sql,
    write_report,
)
from servescope.reports.build import PREVIOUS, previous_run
from servescope.reports.summary import require_run
from servescope.store.lakeread import Lake

DESCRIPTION = "Render stored runs as self-contained HTML, Markdown and JSON reports."


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("report", help="build run reports", description=DESCRIPTION)
    add_subcommands(parser)


def _slo(text: str) -> dict[str, float]:
    slo: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in sql.SLO_METRICS:
            known = ", ".join(sql.SLO_METRICS)
            raise argparse.ArgumentTypeError(f"unknown SLO {name!r}; use {known}")
        try:
            slo[name] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"SLO {name} needs a number of ms, got {value!r}"
            ) from None
    return slo


def add_subcommands(parser: argparse.ArgumentParser) -> None:
    reports = parser.add_subparsers(dest="report_command", required=True, metavar="SUBCOMMAND")
    build = reports.add_parser(
        "build",
        help="write DIR/REPORT/index.html, report.md and report.json",
        description="Summarise one run (requests, errors by class, TTFT/TPOT/ITL/e2e/queue/"
        "prefill/decode percentiles, throughput, goodput, prefix-cache hits client- and "
        "server-side, KV-cache peak, preemptions, admission rejections, the lab's pass "
        "criteria, charts), or compare it with --vs BASE (or before/after its lever flip with "
        "--split-at-flip): before, after, Δ, Δ %, a seeded bootstrap 95 % CI and a verdict per "
        "indicator. TTFT, TPOT and e2e come from the client where it timed them, else from "
        "vLLM's own trace; each indicator names its source and a diff never compares a client "
        "figure with a server figure. --since/--until report a window of a long-lived run. "
        "The report folder is RUN, RUN-vs-BASE or RUN-at-flip (with @FROM-TO for a window), "
        "percent-encoded (a run id is never a path: a/b is a%2Fb; a run id that cannot be typed "
        "may be given so). Exit codes: 0 written, 2 an unknown run (the known ones are named), "
        "no run before RUN for --vs previous, a run with no lever flip to split at, or bad "
        "options.",
        epilog="Times (--since, --until, --vs-since, --vs-until): an ISO time "
        "(2026-11-24T20:00:00Z), a duration ago (90s, 30m, 2h, 1d, 1w), or one from the run's "
        "start or end (start+1h, end-30m). The hour before a restart that flipped a lever vs "
        "the hour after: report build AFTER --until start+1h --vs previous --vs-since end-1h",
    )
    build.add_argument("run_id", metavar="RUN", help="the run to report (the 'after' side)")
    mode = build.add_mutually_exclusive_group()
    mode.add_argument(
        "--vs",
        metavar="BASE_RUN",
        help="compare RUN (after) with BASE_RUN (before); 'previous' = the run the same server "
        "ran before RUN (a server session's predecessor: a restart that flipped a lever)",
    )
    mode.add_argument(
        "--split-at-flip",
        action="store_true",
        help="compare the parts of RUN before and after its lever_flips row",
    )
    add_window_options(build, "report RUN")
    build.add_argument("--vs-since", metavar="TIME", help="the base side from this time on")
    build.add_argument("--vs-until", metavar="TIME", help="the base side up to this time")
    build.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, metavar="DIR", help=f"(default {DEFAULT_OUT})"
    )
    build.add_argument(
        "--format", default=",".join(FORMATS), help=f"comma-separated subset of {','.join(FORMATS)}"
    )
    build.add_argument(
        "--slo",
        type=_slo,
        default={},
        metavar="ttft_ms=…,tpot_ms=…,e2e_ms=…",
        help="SLOs in ms for goodput (requests meeting every one)",
    )
    build.add_argument("--gpu-hour-usd", type=float, help="GPU price per hour, for the cost check")
    build.add_argument(
        "--api-usd-per-1k-tokens", type=float, help="API price per 1K tokens, for the cost check"
    )
    build.add_argument("--seed", type=int, help="bootstrap seed (default: a fixed one)")
    build.add_argument(
        "--prometheus",
        metavar="URL",
        help="a fleet run's per-replica server numbers (counters, KV peak, vLLM's queue/TTFT/"
        "prefill/decode histograms) from this Prometheus, which scrapes the replicas, over the "
        "run's window, instead of servescope's own scrapes",
    )
    build.add_argument(
        "--json", action="store_true", help="print the headline, paths and verdicts as JSON"
    )
    add_store_option(build)
    add_lake_option(build)
    build.set_defaults(func=run_build)

    flips = reports.add_parser(
        "flips",
        help="lever flips and the command that reports each",
        description="Every lever flip in the store (a restart of a server with other levers, "
        "or an experiment's switch), grouped by the runs it goes between, with the report "
        "command that compares them.",
    )
    flips.add_argument("--json", action="store_true", help="print the flips as JSON")
    add_store_option(flips)
    add_lake_option(flips)
    flips.set_defaults(func=run_flips)

    listing = reports.add_parser(
        "list",
        help="stored runs with their levers and event counts",
        description="Every run in the store: events (ok, errors, rejected), lever flips, "
        "model, status and levers.",
    )
    listing.add_argument("--json", action="store_true", help="print the runs as JSON")
    add_store_option(listing)
    add_lake_option(listing)
    listing.set_defaults(func=list_runs)


def run_build(args: argparse.Namespace) -> int:
    formats = tuple(f.strip() for f in args.format.split(",") if f.strip())
    if bad := [f for f in formats if f not in FORMATS]:
        console.print(f"unknown format {bad}; choose from {FORMATS}", style="red")
        return 2
    options = ReportOptions(
        slo=args.slo,
        gpu_hour_usd=args.gpu_hour_usd,
        api_usd_per_1k_tokens=args.api_usd_per_1k_tokens,
        seed=args.seed,
        charts="html" in formats,
        prometheus=args.prometheus,
    )
    window = Window(args.since, args.until)
    base_window = Window(args.vs_since, args.vs_until)
    if base_window and not args.vs:
        console.print("--vs-since/--vs-until need --vs", style="red")
        return 2
    if window and args.split_at_flip:
        console.print("--split-at-flip splits the whole run: drop --since/--until", style="red")
        return 2
    store = open_store(args)
    run_id = run_arg(store, args.run_id)
    base = args.vs if args.vs == PREVIOUS else run_arg(store, args.vs) if args.vs else None
    try:
        if (
            isinstance(store, Lake)
            and store.has_run(run_id)
            and (base in (None, PREVIOUS) or store.has_run(base))
        ):
            # read only the partitions of the runs compared (an unknown run is reported from
            # the whole lake, with the runs it knows)
            store = store.scoped([run_id])
            if base == PREVIOUS:
                with store.read() as con:
                    base = previous_run(con, require_run(con, run_id))
            store = store.scoped([run_id, base] if base else [run_id])
        with console.status("building the report…"):
            if base:
                report = build_diff(store, run_id, base, options, window, base_window)
            elif args.split_at_flip:
                report = build_split(store, run_id, options)
            else:
                report = build_summary(store, run_id, options, window)
            paths = write_report(report, args.out, formats)
    except (UnknownRun, NoLeverFlip, NoPreviousRun, BadWindow, NotAFleet) as exc:
        console.print(str(exc), style="red")
        return 2
    except PrometheusUnavailable as exc:
        console.print(str(exc), style="red")
        return 1
    for warning in report.get("warnings", []):
        console.print(f"warning: {warning}", style="yellow")
    if args.json:
        print(json.dumps(_brief(report, paths)))
    else:
        if "headline" in report:
            console.print(report["headline"])
        for path in paths:
            print(path)
    return 0


def _brief(report: dict[str, Any], paths: list[Path]) -> dict[str, Any]:
    return {
        "report_id": report["report_id"],
        "paths": [str(p) for p in paths],
        "headline": report.get("headline"),
        "warnings": report.get("warnings", []),
        "verdicts": {d["metric"]: d["verdict"] for d in report.get("diff", [])},
    }


def run_flips(args: argparse.Namespace) -> int:
    store = open_store(args)
    with store.read() as con:
        flips = rows(con.execute(sql.FLIP_LIST))
    for flip in flips:
        before = flip["before_run_id"]
        flip["report"] = (
            f"report build {flip['run_id']} --vs {before}"
            if before
            else f"report build {flip['run_id']} --split-at-flip"
        )
    if args.json:
        print(json.dumps(flips, default=str))
        return 0
    table = Table(title=f"lever flips in {store.path}")
    for column in ("when (UTC)", "from run", "to run", "levers", "report"):
        table.add_column(column)
    for flip in flips:
        levers = "\n".join(
            f"{c['lever']} {c['before'] or 'unset'} → {c['after'] or 'unset'}"
            for c in flip["changes"]
        )
        cells = (flip["ts"], flip["before_run_id"] or "", flip["run_id"] or "", levers,
                 flip["report"])  # fmt: skip
        table.add_row(*(Text(str(c)) for c in cells))
    Console(width=None if sys.stdout.isatty() else 240).print(table)
    return 0
