"""`servescope experiment`: lever-flip experiments (a seeded workload, two or more server
profiles, a fresh vLLM per run) and their before/after reports."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from servescope.commands import bench
from servescope.commands.common import add_store_option, console, open_store
from servescope.loadgen.experiment import (
    Experiment,
    ExperimentHooks,
    ExperimentResult,
    load_experiments,
)
from servescope.loadgen.fleet import FleetExperiment
from servescope.loadgen.launcher import VllmServer
from servescope.loadgen.runner import parse_slo, percentile
from servescope.loadgen.sidecar import CollectorSidecar
from servescope.loadgen.tiny_model import DIRS, is_built, make_tiny_model
from servescope.loadgen.workload import BenchConfig, WorkloadError
from servescope.reports import DEFAULT_OUT, build_diff, build_summary, write_report
from servescope.store import Store


def register(sub: argparse._SubParsersAction) -> None:
    experiments = load_experiments()
    parser = sub.add_parser(
        "experiment",
        help="lever-flip experiments: one workload, several server profiles, before/after",
    )
    commands = parser.add_subparsers(dest="experiment_command", required=True, metavar="SUBCOMMAND")
    listing = commands.add_parser("list", help="the built-in experiments")
    listing.set_defaults(func=run_list)
    run = commands.add_parser(
        "run",
        help="run an experiment and build its reports",
        description="Run one seeded workload against each profile of the experiment: a fresh "
        "vLLM per run (caches start cold; about 80-120 s to start on a CPU), warm-up, one "
        "stored run with the profile's levers, a lever_flips row at each switch, repeats "
        "interleaved (A B A B). Then the reports are written and their paths printed, one per "
        "line. Built in: "
        + "; ".join(f"{n}: {e.description}" for n, e in experiments.items())
        + ". Exit codes: 0 ok; 1 a server failed, requests failed or Ctrl-C (what was measured "
        "is stored, the run marked partial); 2 an unknown experiment or a bad option.",
    )
    run.add_argument("name", metavar="NAME", help=f"one of {', '.join(experiments)}")
    run.add_argument("--repeats", type=int, default=1, help="runs per profile, interleaved")
    run.add_argument("--scale", type=float, default=None, help="prompt size factor override")
    run.add_argument("--requests", type=int, default=None, help="requests per level override")
    run.add_argument("--slo", default=None, help="goodput bounds, e.g. ttft_ms=500,tpot_ms=50")
    run.add_argument(
        "--target",
        action="append",
        default=None,
        metavar="PROFILE=URL",
        help="use a running server for a profile instead of launching one (caches stay warm)",
    )
    run.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="a vLLM flag added to every server the experiment starts, after the profile's "
        "(so it wins), recorded in the runs' levers; repeatable, written with '=': "
        "--server-arg=--max-model-len=4096",
    )
    run.add_argument(
        "--model",
        type=Path,
        default=None,
        help="model dir (default: the tiny model of the experiment's kind, "
        + ", ".join(f"{k} {d}" for k, d in DIRS.items())
        + "; built when missing)",
    )
    run.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"(default {DEFAULT_OUT})")
    run.add_argument("--json", action="store_true", help="print the outcome as JSON")
    add_store_option(run)
    run.set_defaults(func=run_experiment)


def run_list(args: argparse.Namespace) -> int:
    for name, spec in load_experiments().items():
        print(f"{name}: {spec.workload} x {' vs '.join(spec.profiles)} — {spec.description}")
    return 0


def _targets(pairs: list[str] | None) -> dict[str, str] | None:
    if not pairs:
        return None
    targets = {}
    for pair in pairs:
        profile, sep, url = pair.partition("=")
        if not sep or not url:
            raise ValueError(f"--target takes PROFILE=URL, got {pair!r}")
        targets[profile] = url
    return targets


def run_experiment(args: argparse.Namespace) -> int:
    experiments = load_experiments()
    if args.name not in experiments:
        console.print(
            f"unknown experiment {args.name!r}; built in: {', '.join(experiments)}", style="red"
        )
        return 2
    spec = experiments[args.name]
    model = args.model or DIRS.get(spec.model)
    if model is None:
        console.print(f"experiment {args.name}: unknown model kind {spec.model!r}", style="red")
        return 2
    store = open_store(args, create=True)
    experiment: Experiment | FleetExperiment
    try:
        if spec.fleet is not None:
            if args.target:
                raise ValueError(
                    f"experiment {spec.name} starts its own replicas behind a gateway: "
                    "--target is not for it"
                )
            experiment = FleetExperiment(
                spec,
                store=store,
                execute=execute,
                model=model,
                repeats=args.repeats,
                scale=args.scale,
                requests=args.requests,
                slo=parse_slo(args.slo),
                hooks=hooks(store),
            )
        else:
            experiment = Experiment(
                spec,
                store=store,
                execute=execute,
                model=model,
                targets=_targets(args.target),
                repeats=args.repeats,
                scale=args.scale,
                requests=args.requests,
                slo=parse_slo(args.slo),
                hooks=hooks(store),
                server_flags=args.server_arg,
            )
    except (WorkloadError, ValueError) as exc:
        console.print(f"{exc}", style="red")
        return 2
    if not args.target and not ready_model(model, spec.model, given=args.model is not None):
        console.print(f"experiment {args.name}: no model folder at {model}", style="red")
        return 2
    result = experiment.run()
    paths = build_reports(store, result, args.out)
    rows = outcome_rows(store, result)
    console.print(outcome_table(rows, console))
    if args.json:
        print(json.dumps({**_outcome(result), "runs": rows, "reports": [str(p) for p in paths]}))
    else:
        for path in paths:
            print(path.resolve())
    if result.status != "complete":
        console.print(f"experiment {result.status}: {result.failure or 'interrupted'}", style="red")
        return 1
    failed = sum(r.result.errors for r in result.runs if r.result)
    if failed:
        console.print(f"{failed} requests failed; see the reports' error classes", style="red")
        return 1
    return 0


def ready_model(model: Path, kind: str, *, given: bool) -> bool:
    """Whether the servers have a model folder to load. Only the default folder of a tiny model
    is built when missing: a folder the user names is theirs (an 8B config served with
    `--load-format dummy` has no weights and must stay as it is)."""
    if given:
        return (model / "config.json").is_file()
    if not is_built(model):
        with console.status(f"building the {kind} tiny model in {model}"):
            make_tiny_model(model, kind=kind)
    return True


def hooks(store: Store) -> ExperimentHooks:
    """The display, and the collector as the sidecar of every server an experiment starts."""
    return ExperimentHooks(
        starting=starting,
        ready=ready,
        sidecar=lambda log, url: CollectorSidecar(store, log, url, notice=_notice),
    )


def execute(config: BenchConfig, target: str, store: Store, options: dict[str, Any]) -> Any:
    return bench.execute(config, target, store, **options)


def _notice(message: str, warning: bool = False) -> None:
    console.print(message, style="yellow" if warning else None)


def starting(profile: str, server: VllmServer) -> None:
    console.print(
        Text.assemble(
            "starting vLLM ", (profile, "bold"), f" on {server.url} (log {server.log_path})"
        )
    )


def ready(profile: str, server: VllmServer) -> None:
    console.print(f"vLLM {profile} ready after {server.ready_s:.0f} s")


def build_reports(store: Store, result: ExperimentResult, out: Path) -> list[Path]:
    """The before/after report of every profile switch (`report build B --vs A`); a run with
    no partner (an experiment stopped after its first run) gets its own summary. Returns the
    HTML pages."""
    reports = [build_diff(store, after.run_id, before.run_id) for before, after in result.pairs()]
    paired = {run.run_id for pair in result.pairs() for run in pair}
    reports += [
        build_summary(store, run.run_id)
        for run in result.runs
        if run.run_id not in paired and store.has_run(run.run_id)
    ]
    paths: list[Path] = []
    for report in reports:
        written = write_report(report, out)
        paths.append(next(p for p in written if p.name == "index.html"))
    return paths


def outcome_rows(store: Store, result: ExperimentResult) -> list[dict[str, Any]]:
    """One row per run: the indicators the experiment is about, client and server side."""
    rows = []
    for run in result.runs:
        if run.result is None:
            continue
        events = store.export_events(run.run_id)
        ok = [e for e in events if e.get("status") == "ok"]
        ttft = [e["ttft_ms"] for e in ok if e.get("ttft_ms") is not None]
        tpot = [e["tpot_ms"] for e in ok if e.get("tpot_ms") is not None]
        probes = [e["ttft_ms"] for e in ok if e.get("request_class") == "probe" and "ttft_ms" in e]
        rows.append(
            {
                "run_id": run.run_id,
                "profile": run.profile,
                "repeat": run.repeat,
                "status": run.result.status,
                "requests": run.result.events,
                "errors": run.result.errors,
                "ttft_ms_p50": percentile(ttft, 0.5),
                "ttft_ms_p95": percentile(ttft, 0.95),
                "probe_ttft_ms_p50": percentile(probes, 0.5),
                "tpot_ms_p50": percentile(tpot, 0.5),
                "server_prefix_cache_hit_ratio": run.result.server.get("prefix_cache_hit_ratio"),
                "client_cached_token_ratio": run.result.client.get("cached_token_ratio"),
                "preemptions": run.result.server.get("preemptions"),
                "spec_decode_acceptance_rate": run.result.server.get("spec_decode_acceptance_rate"),
                "server_ready_s": run.server_ready_s,
            }
        )
    return rows


# The indicators of the outcome table: (heading, outcome_rows key, format)
OUTCOME_INDICATORS: list[tuple[str, str, str]] = [
    ("requests", "requests", ""),
    ("errors", "errors", ""),
    ("TTFT p50 ms", "ttft_ms_p50", ".0f"),
    ("TTFT p95 ms", "ttft_ms_p95", ".0f"),
    ("probe TTFT p50 ms", "probe_ttft_ms_p50", ".0f"),
    ("server hit ratio", "server_prefix_cache_hit_ratio", ".1%"),
    ("client cached ratio", "client_cached_token_ratio", ".1%"),
    ("TPOT p50 ms", "tpot_ms_p50", ".1f"),
    ("draft acceptance", "spec_decode_acceptance_rate", ".1%"),
]
OUTCOME_NOTE = (
    "server hit ratio: Δhits/Δqueries; client cached ratio: cached_tokens/prompt_tokens; "
    "draft acceptance: accepted/draft tokens"
)


def outcome_table(rows: list[dict[str, Any]], console: Console) -> RenderableType:
    """The runs' indicators: one line per run where the console is wide enough for every
    indicator side by side, else one column per run (as many runs a table as fit), so that a
    pipe or an 80-column terminal shows every heading and figure whole."""
    wide = _runs_by_row(rows)
    unbounded = console.options.update_width(1 << 16)
    if console.measure(wide, options=unbounded).maximum <= console.width:
        return wide
    labels = _run_labels(rows)
    heading = max(len(h) for h, _k, _f in OUTCOME_INDICATORS)
    per_run = max([len(label) for label in labels] + [len("100.0%")]) + 3  # cell + borders
    fit = max(1, (console.width - heading - 4) // per_run)
    tables: list[RenderableType] = [
        _runs_by_column(rows[i : i + fit], labels[i : i + fit]) for i in range(0, len(rows), fit)
    ]
    return Group(*tables, Text(OUTCOME_NOTE, style="dim"))


def _cell(row: dict[str, Any], key: str, spec: str) -> str:
    value = row.get(key)
    return "n/a" if value is None else format(value, spec)


def _runs_by_row(rows: list[dict[str, Any]]) -> Table:
    table = Table(
        "profile", *(h for h, _k, _f in OUTCOME_INDICATORS), title=f"runs ({OUTCOME_NOTE})"
    )
    for row in rows:
        table.add_row(row["profile"], *(_cell(row, k, f) for _h, k, f in OUTCOME_INDICATORS))
    return table


def _runs_by_column(rows: list[dict[str, Any]], labels: list[str]) -> Table:
    table = Table("run", *labels, title="runs")
    for column in table.columns[1:]:
        column.justify = "right"
    for heading, key, spec in OUTCOME_INDICATORS:
        table.add_row(heading, *(_cell(row, key, spec) for row in rows))
    return table


def _run_labels(rows: list[dict[str, Any]]) -> list[str]:
    """Each run's profile, with its repeat when a profile ran more than once."""
    repeated = len({r["profile"] for r in rows}) < len(rows)
    return [f"{r['profile']} r{r['repeat']}" if repeated else r["profile"] for r in rows]


def _outcome(result: ExperimentResult) -> dict[str, Any]:
    return {
        "experiment": result.name,
        "experiment_id": result.experiment_id,
        "status": result.status,
        "failure": result.failure,
    }
