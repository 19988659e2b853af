"""`servescope bench run`: a workload file against a running OpenAI-compatible server."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.runner import BenchRun, LevelProgress, RunResult
from bench.workload import BenchConfig, Workload, WorkloadError, load_config
from servescope.commands.common import add_store_option, console, open_store
from store import Store


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bench", help="run benchmark workloads against a vLLM server")
    benches = parser.add_subparsers(dest="bench_command", required=True, metavar="SUBCOMMAND")
    run = benches.add_parser(
        "run",
        help="run a workload file (Lab 10 benchmark_config.yaml format)",
        description="Closed loop: for each workload and concurrency level, keep exactly that many "
        "streaming requests in flight. Every request becomes one event in "
        "servescope-data/events/RUN.events.jsonl and in the store. Exits 1 when any request "
        "failed.",
    )
    run.add_argument("--config", type=Path, required=True, help="workload YAML file")
    run.add_argument("--target", default="http://127.0.0.1:8000", help="server base URL")
    run.add_argument("--run-id", default=None, help="run id (default run-YYYYMMDD-HHMMSS)")
    run.add_argument(
        "--model", default=None, help="served model name (default: the server's first)"
    )
    run.add_argument("--json", action="store_true", help="print the run result as JSON")
    add_store_option(run)
    run.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
    except WorkloadError as exc:
        console.print(f"[red]{exc}")
        return 2
    result = execute(config, args.target, open_store(args), run_id=args.run_id, model=args.model)
    if args.json:
        print(json.dumps({**result.__dict__, "events_path": str(result.events_path)}))
    else:
        console.print(
            f"run {result.run_id}: {result.events} requests, {result.errors} failed; "
            f"events in {result.events_path}"
        )
    if result.errors:
        console.print(f"[red]{result.errors} requests failed: {result.error_classes}")
        return 1
    return 0


def execute(config: BenchConfig, target: str, store: Store, **kwargs: Any) -> RunResult:
    """Run with a progress bar: one task per workload level."""
    total = sum(w.requests_per_level * len(w.concurrency) for w in config.workloads)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        overall = progress.add_task("all requests", total=total)
        level_task: dict[str, Any] = {}

        def on_level(workload: Workload, concurrency: int) -> None:
            if "id" in level_task:
                progress.update(level_task["id"], visible=False)
            level_task["id"] = progress.add_task(
                f"{workload.name} @ concurrency {concurrency}", total=workload.requests_per_level
            )

        def on_request(event: dict[str, Any]) -> None:
            progress.advance(overall)
            progress.advance(level_task["id"])

        run = BenchRun(
            config, target, store=store, progress=LevelProgress(on_level, on_request), **kwargs
        )
        return asyncio.run(run.run())
