"""`servescope bench run`: a workload file against a running OpenAI-compatible server."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from servescope.commands.common import (
    add_slo_option,
    command_group,
    console,
    open_store,
    store_command,
)
from servescope.loadgen.probe import TargetUnreachable
from servescope.loadgen.request import ClientEvent
from servescope.loadgen.runner import BenchRun, LevelProgress, RunOptions, RunResult
from servescope.loadgen.workload import BenchConfig, Workload, WorkloadError, load_config, shipped
from servescope.store import Store, settings

EXIT_HELP = (
    "Exit codes: 0 every request succeeded; 1 requests failed, the target was unreachable or "
    "the run was interrupted (Ctrl-C: in-flight requests are cancelled, what was measured is "
    "stored and the run is marked partial); 2 a bad workload file or option."
)


def register(sub: argparse._SubParsersAction) -> None:
    benches = command_group(sub, "bench", help="run benchmark workloads against a vLLM server")
    run = benches.add_parser(
        "run",
        help="run a workload file: a benchmark config (name, model, input_tokens, output_tokens, "
        "concurrency, requests_per_level, metrics) plus scenario keys",
        description="For each workload and load level: closed loop (`concurrency`: keep that "
        "many streaming requests in flight) or open loop (`rate` with constant/poisson/gamma "
        "arrivals: intended and actual send times recorded, a client that cannot keep up is "
        "reported as saturated). The target's /metrics is scraped every second; the run's "
        "notes hold the server-side prefix-cache hit ratio, preemptions, peak running/waiting "
        "and KV-cache peak next to the client's numbers. Every request becomes one event in "
        "servescope-data/events/RUN.events.jsonl and in the store. Shipped scenarios: "
        + ", ".join(shipped())
        + ". "
        + EXIT_HELP,
    )
    add_workload_options(run)
    default_target = f"http://{settings.HOST}:{settings.VLLM_PORT}"
    run.add_argument("--target", default=default_target, help=f"server base URL ({default_target})")
    run.add_argument("--run-id", default=None, help="run id (default run-YYYYMMDD-HHMMSS)")
    run.add_argument("--label", default=None, help="a label stored with the run")
    run.add_argument(
        "--model", default=None, help="served model name (default: the server's first)"
    )
    run.add_argument(
        "--replica",
        action="append",
        default=None,
        metavar="NAME=URL",
        help="a replica behind the target (a gateway pool member, NAME as in gateway.yaml): its "
        "/metrics is scraped with the target's and the report gets a per-replica table "
        "(repeatable)",
    )
    store_command(run, run_bench, json_help="print the run result as JSON")


def parse_replicas(pairs: list[str] | None) -> dict[str, str]:
    """`--replica NAME=URL` options as {name: url} (ValueError names the bad one)."""
    replicas: dict[str, str] = {}
    for pair in pairs or []:
        name, sep, url = pair.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise ValueError(f"--replica takes NAME=http://HOST:PORT, got {pair!r}")
        if name in replicas:
            raise ValueError(f"--replica {name} is given twice")
        replicas[name] = url
    return replicas


def add_workload_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        required=True,
        help="workload YAML file, or the name of a shipped scenario (e.g. ralph-loop)",
    )
    parser.add_argument(
        "--workload",
        action="append",
        default=None,
        help="run only this workload of the file (repeatable)",
    )
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply every prompt size (0.25 runs a workload's 8K-token prefix as 2K on a CPU)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests per level, overriding the file's requests_per_level/duration_s",
    )
    add_slo_option(
        parser, "ttft_ms=…,tpot_ms=…,e2e_ms=…", "goodput bounds in ms, e.g. ttft_ms=500,tpot_ms=50"
    )


def config_from(args: argparse.Namespace) -> tuple[BenchConfig, dict[str, float]]:
    """The workload file as selected and scaled, and the SLO (WorkloadError/ValueError if bad)."""
    config = load_config(args.config)
    if args.workload:
        config = config.select(args.workload)
    if args.requests is not None:
        config = config.with_requests(args.requests)
    return config.scaled(args.scale), args.slo


def run_bench(args: argparse.Namespace) -> int:
    try:
        config, slo = config_from(args)
        replicas = parse_replicas(args.replica)
    except (WorkloadError, ValueError) as exc:
        console.print(f"{exc}", style="red")
        return 2
    try:
        options = RunOptions(
            run_id=args.run_id, model=args.model, slo=slo, label=args.label, replicas=replicas
        )
        result = execute(config, args.target, open_store(args, create=True), options)
    except TargetUnreachable as exc:
        console.print(f"{exc}", style="red")
        return 1
    if args.json:
        print(json.dumps(result.to_json(), default=str))
    return report_result(result)


def report_result(result: RunResult) -> int:
    """Tell the user how the run went (stderr); the exit code of the run."""
    ratio = result.server["prefix_cache_hit_ratio"] if result.server else None
    console.print(
        f"run {result.run_id} ({result.status}): {result.events} requests, {result.errors} "
        f"failed; server prefix-cache hit ratio "
        f"{'n/a' if ratio is None else f'{ratio:.1%}'}; events in {result.events_path}"
    )
    for level in result.saturated_levels:
        lag = level["schedule_lag_ms"]["p99"]
        console.print(
            f"client saturated at {level['workload']} rate {level['target_rate']}/s: "
            f"achieved {level['achieved_rate'] or 0:.2f}/s, schedule lag p99 {lag:.0f} ms — "
            "the numbers of that level measure the client, not the server",
            style="yellow",
        )
    if result.failure:
        console.print(result.failure, style="red")
    if result.status == "partial":
        console.print(
            f"interrupted: {result.cancelled_in_flight} in-flight requests cancelled; "
            f"the {result.events} measured requests are stored, run marked partial",
            style="yellow",
        )
        return 1
    if result.errors:
        classes = ", ".join(f"{k}: {v}" for k, v in sorted(result.error_classes.items()))
        hint = (
            " — the target stopped accepting connections (did the server die?)"
            if "connect" in result.error_classes
            else ""
        )
        console.print(
            f"{result.errors} of {result.events} requests failed ({classes}){hint}", style="red"
        )
        return 1
    return 0 if result.status == "complete" else 1


def execute(config: BenchConfig, target: str, store: Store, options: RunOptions) -> RunResult:
    """Run with a progress bar: one task for the run, one per workload level."""
    total = config.requests_total()
    with Progress(
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        overall = progress.add_task("all requests", total=total)
        level_task: dict[str, Any] = {}

        def on_level(workload: Workload, level: float, count: int | None) -> None:
            if "id" in level_task:
                progress.update(level_task["id"], visible=False)
            what = f"rate {level}/s" if workload.open_loop else f"concurrency {int(level)}"
            level_task["id"] = progress.add_task(f"{workload.name} @ {what}", total=count)

        def on_request(_event: ClientEvent) -> None:
            progress.advance(overall)
            progress.advance(level_task["id"])

        run = BenchRun(
            config,
            target,
            store=store,
            options=options,
            progress=LevelProgress(on_level, on_request),
        )
        return asyncio.run(run.run())
