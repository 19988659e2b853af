"""`servescope report build RUN [--vs BASE | --split-at-flip]`, `report flips` and `report list`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TypedDict

from rich.console import Console
from rich.table import Table
from rich.text import Text

from servescope.commands.common import (
    add_slo_option,
    add_window_options,
    command_group,
    console,
    list_runs,
    open_store,
    run_arg,
    store_command,
)
from servescope.reports import (
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
    write_report,
)
from servescope.reports.build import PREVIOUS, BadComparison, previous_run
from servescope.reports.document import Design, DiffRow, Primary, Report
from servescope.reports.judge import WHOLE_RUN
from servescope.reports.summary import require_run
from servescope.store import Store, reads, settings
from servescope.store.lakeread import Lake

FAIL_ON = ("improved", "regressed")
EXIT_VERDICT = 3
DESCRIPTION = "Render stored runs as self-contained HTML, Markdown and JSON reports."


def register(sub: argparse._SubParsersAction) -> None:
    add_subcommands(command_group(sub, "report", help="build run reports", description=DESCRIPTION))


def _verdicts(text: str) -> tuple[str, ...]:
    chosen = tuple(v.strip() for v in text.split(",") if v.strip())
    if not chosen or any(v not in FAIL_ON for v in chosen):
        raise argparse.ArgumentTypeError(
            f"--fail-on takes {' or '.join(FAIL_ON)} (comma-separated), got {text!r}"
        )
    return chosen


# A declarative table (argparse set-up, one statement per option): longer than 80 lines by
# design, as the house rule allows.
def add_subcommands(reports: argparse._SubParsersAction) -> None:
    build = reports.add_parser(
        "build",
        help="write DIR/REPORT/index.html, report.md and report.json",
        description="Summarise one run (requests, errors by class, TTFT/TPOT/ITL/e2e/queue/"
        "prefill/decode percentiles, throughput, goodput, prefix-cache hits client- and "
        "server-side, KV-cache peak, preemptions, admission rejections, a vLLM "
        "deployment's pass criteria, charts), or compare it with --vs BASE (or before/after "
        "its lever flip with --split-at-flip): before, after, Δ, Δ %, a seeded bootstrap 95 % "
        "CI and a verdict per indicator. TTFT, TPOT and e2e come from the client where it "
        "timed them, else from vLLM's own trace; each indicator names its source and a diff "
        "never compares a client figure with a server figure. Several runs a side (report "
        "build A1 A2 A3 --vs B1 B2 B3) "
        "are repeats of one configuration: each load level is compared with its counterpart, "
        "the interval covers run-to-run as well as request-to-request variation, each repeat's "
        "value is shown beside the pooled one, and every row says the smallest change the "
        "design could have detected; with one run a side the interval covers request noise "
        "only, and the report says so. The primary indicator (the symptom the flipped lever "
        "targets, or --primary) is tested at 5 %, the other rows corrected as a family "
        "(Holm, 2.5 % family-wise). "
        "--since/--until report a window of a long-lived run. "
        "The report folder is RUN, RUN-vs-BASE or RUN-at-flip (with @FROM-TO for a window; "
        "RUN-x3-vs-BASE-x3 for three repeats a side, named by the first), "
        "percent-encoded (a run id is never a path: a/b is a%2Fb; a run id that cannot be typed "
        "may be given so). Exit codes: 0 written, 2 an unknown run (the known ones are named), "
        "no run before RUN for --vs previous, a run with no lever flip to split at, or bad "
        "options; 3 a verdict named by --fail-on (the report is written first).",
        epilog="Times (--since, --until, --vs-since, --vs-until): an ISO time "
        "(2026-11-24T20:00:00Z), a duration ago (90s, 30m, 2h, 1d, 1w), or one from the run's "
        "start or end (start+1h, end-30m). The hour before a restart that flipped a lever vs "
        "the hour after: servescope report build AFTER --until start+1h --vs previous "
        "--vs-since end-1h",
    )
    build.add_argument(
        "run_id",
        metavar="RUN",
        nargs="+",
        help="the run to report (the 'after' side); several: repeats of one configuration",
    )
    mode = build.add_mutually_exclusive_group()
    mode.add_argument(
        "--vs",
        metavar="BASE_RUN",
        nargs="+",
        help="compare RUN (after) with BASE_RUN (before), each one run or several repeats; "
        "'previous' = the run the same server ran before RUN (a server session's predecessor: "
        "a restart that flipped a lever)",
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
        "--out",
        type=Path,
        default=settings.reports_dir(),
        metavar="DIR",
        help=f"(default {settings.reports_dir()})",
    )
    build.add_argument(
        "--format", default=",".join(FORMATS), help=f"comma-separated subset of {','.join(FORMATS)}"
    )
    add_slo_option(
        build, "ttft_ms=…,tpot_ms=…,e2e_ms=…", "SLOs in ms for goodput (requests meeting every one)"
    )
    build.add_argument("--gpu-hour-usd", type=float, help="GPU price per hour, for the cost check")
    build.add_argument(
        "--api-usd-per-1k-tokens", type=float, help="API price per 1K tokens, for the cost check"
    )
    build.add_argument("--seed", type=int, help="bootstrap seed (default: a fixed one)")
    build.add_argument(
        "--primary",
        metavar="METRIC",
        help="the diff row the flip is judged by, decided by the stopping rule (the others "
        "are corrected as a family), e.g. ttft_ms.p95, tpot_ms.p50, "
        "throughput.output_tokens_per_s, error_rate; default: the symptom the flipped lever "
        "targets (reports/diagnosis.yaml), else ttft_ms.p50",
    )
    build.add_argument(
        "--margin",
        type=float,
        default=None,
        metavar="PCT",
        help="the primary is unchanged when its interval lies within ±PCT %% (a share's: "
        "within ±PCT/10 points); default: the runs' experiment's, else 10",
    )
    build.add_argument(
        "--fail-on",
        type=_verdicts,
        default=(),
        metavar="VERDICTS",
        help="exit 3 when a tested row of the diff has one of these verdicts after the "
        "correction: 'regressed' gates a deploy on regressions, 'improved,regressed' on any "
        "change (--json names the rows)",
    )
    build.add_argument(
        "--prometheus",
        metavar="URL",
        help="a fleet run's per-replica server numbers (counters, KV peak, vLLM's queue/TTFT/"
        "prefill/decode histograms) from this Prometheus, which scrapes the replicas, over the "
        "run's window, instead of servescope's own scrapes",
    )
    store_command(
        build, run_build, json_help="print the headline, paths and verdicts as JSON", lake=True
    )

    flips = reports.add_parser(
        "flips",
        help="lever flips and the command that reports each",
        description="Every lever flip in the store (a restart of a server with other levers, "
        "or an experiment's switch), grouped by the runs it goes between, with the report "
        "command that compares them.",
    )
    store_command(flips, run_flips, json_help="print the flips as JSON", lake=True)

    listing = reports.add_parser(
        "list",
        help="stored runs with their levers and event counts",
        description="Every run in the store: events (ok, errors, rejected), lever flips, "
        "model, status and levers.",
    )
    store_command(listing, list_runs, json_help="print the runs as JSON", lake=True)


def run_build(args: argparse.Namespace) -> int:
    formats = tuple(f.strip() for f in args.format.split(",") if f.strip())
    window, base_window = Window(args.since, args.until), Window(args.vs_since, args.vs_until)
    if problem := _usage_problem(args, formats, window, base_window):
        console.print(problem, style="red")
        return 2
    store = open_store(args)
    run_ids = [run_arg(store, r) for r in args.run_id]
    bases = None
    if args.vs:
        bases = args.vs if args.vs == [PREVIOUS] else [run_arg(store, r) for r in args.vs]
    try:
        store, bases = _scoped(store, run_ids, bases)
        with console.status("building the report…"):
            report = _build(args, store, run_ids, bases, formats, (window, base_window))
            paths = write_report(report, args.out, formats)
    except (UnknownRun, NoLeverFlip, NoPreviousRun, BadWindow, NotAFleet, BadComparison) as exc:
        console.print(str(exc), style="red")
        return 2
    except PrometheusUnavailable as exc:
        console.print(str(exc), style="red")
        return 1
    return _said(args, report, paths)


def _usage_problem(
    args: argparse.Namespace, formats: tuple[str, ...], window: Window, base_window: Window
) -> str | None:
    """Why the options cannot make a report (None: they can)."""
    if bad := [f for f in formats if f not in FORMATS]:
        return f"unknown format {bad}; choose from {FORMATS}"
    if args.margin is not None and not 0 < args.margin < 100:
        return f"--margin is a percentage between 0 and 100, got {args.margin}"
    if base_window and not args.vs:
        return "--vs-since/--vs-until need --vs"
    if window and args.split_at_flip:
        return "--split-at-flip splits the whole run: drop --since/--until"
    return _arms_problem(args, window, base_window)


def _scoped(
    store: Store, run_ids: list[str], bases: list[str] | None
) -> tuple[Store, list[str] | None]:
    """A lake read only in the partitions of the runs compared, `previous` resolved there (an
    unknown run is reported from the whole lake, with the runs it knows); a store as it is."""
    if not (
        isinstance(store, Lake)
        and all(store.has_run(r) for r in run_ids)
        and (bases in (None, [PREVIOUS]) or all(store.has_run(b) for b in bases or []))
    ):
        return store, bases
    scoped = store.scoped(run_ids)
    if bases == [PREVIOUS]:
        with scoped.read() as con:
            bases = [previous_run(con, require_run(con, run_ids[0]))]
    return store.scoped([*run_ids, *(bases or [])]), bases


def _build(
    args: argparse.Namespace,
    store: Store,
    run_ids: list[str],
    bases: list[str] | None,
    formats: tuple[str, ...],
    windows: tuple[Window, Window],
) -> Report:
    """The report the options ask for: a diff (--vs), a split (--split-at-flip) or a run's."""
    options = ReportOptions(
        slo=args.slo,
        gpu_hour_usd=args.gpu_hour_usd,
        api_usd_per_1k_tokens=args.api_usd_per_1k_tokens,
        seed=args.seed,
        charts="html" in formats,
        prometheus=args.prometheus,
        margin_pct=args.margin,
    )
    if bases:
        return build_diff(store, run_ids, bases, options, *windows, args.primary)
    if args.split_at_flip:
        return build_split(store, run_ids[0], options, args.primary)
    return build_summary(store, run_ids[0], options, windows[0])


def _said(args: argparse.Namespace, report: Report, paths: list[Path]) -> int:
    """The warnings, the headline and the paths (or --json's brief); EXIT_VERDICT when a row
    has a verdict --fail-on names."""
    for warning in report.get("warnings", []):
        console.print(f"warning: {warning}", style="yellow")
    failing = [r for r in report.get("diff", []) if r["verdict"] in args.fail_on]
    if args.json:
        print(json.dumps(_brief(report, paths, args.fail_on, failing)))
    else:
        if "headline" in report:
            console.print(report["headline"])
        for path in paths:
            print(path)
    if failing:
        named = ", ".join(f"{r['metric']} at {r['level']} {r['verdict']}" for r in failing)
        console.print(f"--fail-on {','.join(args.fail_on)}: {named}", style="red")
        return EXIT_VERDICT
    return 0


def _arms_problem(args: argparse.Namespace, window: Window, base_window: Window) -> str | None:
    """Why the runs named cannot be compared as given (None: they can)."""
    several = len(args.run_id) > 1 or len(args.vs or []) > 1
    if len(args.run_id) > 1 and not args.vs:
        return "several runs are repeats of one arm: compare them with --vs BASE [BASE …]"
    if several and (window or base_window):
        return "--since/--until/--vs-since/--vs-until take one run a side"
    if args.vs and PREVIOUS in args.vs and (len(args.vs) > 1 or len(args.run_id) > 1):
        return "--vs previous compares one run with the run before it: name repeats by their ids"
    if (args.fail_on or args.primary) and not args.vs and not args.split_at_flip:
        return "--fail-on and --primary judge a comparison: give --vs BASE or --split-at-flip"
    return None


class FailingRow(TypedDict):
    metric: str
    level: str
    verdict: str
    delta_pct: float | None
    ci95_pct: list[float] | None
    p_adjusted: float | None


class FailOn(TypedDict):
    verdicts: list[str]
    exit: int
    rows: list[FailingRow]


class Brief(TypedDict):
    """`report build --json`: what a CI step reads of the report (report.json has the rest)."""

    report_id: str
    paths: list[str]
    headline: str | None
    warnings: list[str]
    repeats: Design | None
    primary: Primary | None
    verdicts: dict[str, str]  # metric (metric@level with several levels) → its verdict
    fail_on: FailOn


def _brief(
    report: Report, paths: list[Path], fail_on: tuple[str, ...], failing: list[DiffRow]
) -> Brief:
    rows = report.get("diff", [])
    several = len({r["level"] for r in rows if r["level"] != WHOLE_RUN}) > 1
    return Brief(
        report_id=report["report_id"],
        paths=[str(p) for p in paths],
        headline=report.get("headline"),
        warnings=report.get("warnings", []),
        repeats=report.get("repeats"),
        primary=report.get("primary"),
        verdicts={
            (
                f"{d['metric']}@{d['level']}"
                if several and d["level"] != WHOLE_RUN
                else d["metric"]
            ): d["verdict"]
            for d in rows
        },
        fail_on=FailOn(
            verdicts=list(fail_on),
            exit=EXIT_VERDICT if failing else 0,
            rows=[reads.picked(FailingRow, r) for r in failing],
        ),
    )


def run_flips(args: argparse.Namespace) -> int:
    store = open_store(args)
    with store.read() as con:
        flips = reads.flips(con)
    commands = [
        f"servescope report build {flip['run_id']} --vs {flip['before_run_id']}"
        if flip["before_run_id"]
        else f"servescope report build {flip['run_id']} --split-at-flip"
        for flip in flips
    ]
    if args.json:
        rows = [{**flip, "report": c} for flip, c in zip(flips, commands, strict=True)]
        print(json.dumps(rows, default=str))
        return 0
    table = Table(title=f"lever flips in {store.path}")
    for column in ("when (UTC)", "from run", "to run", "levers", "report"):
        table.add_column(column)
    for flip, command in zip(flips, commands, strict=True):
        levers = "\n".join(
            f"{c['lever']} {c['before'] or 'unset'} → {c['after'] or 'unset'}"
            for c in flip["changes"]
        )
        cells = (flip["ts"], flip["before_run_id"] or "", flip["run_id"] or "", levers,
                 command)  # fmt: skip
        table.add_row(*(Text(str(c)) for c in cells))
    Console(width=None if sys.stdout.isatty() else 240).print(table)
    return 0
