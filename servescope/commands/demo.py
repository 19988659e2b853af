"""`servescope demo`: the whole path on real parts, what `make demo` runs."""

from __future__ import annotations

import argparse
from pathlib import Path

import bench as bench_room
from bench.launcher import ServerFailed, VllmServer
from bench.runner import default_run_id
from bench.tiny_model import DEFAULT_DIR, is_built, make_tiny_model
from bench.workload import load_config
from reports.render import DEFAULT_OUT, write_report
from reports.summary import run_summary
from servescope.commands import bench
from servescope.commands.common import add_store_option, console, open_store

SEED_WORKLOAD = Path(bench_room.__file__).parent / "workloads" / "seed-lab10.yaml"


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "demo",
        help="tiny model → vLLM → bench → store → report, end to end",
        description="Make the tiny model if absent, start vLLM on the CPU with the default "
        "profile, run the Lab 10 seed workload, store every request, build the report, stop "
        "vLLM and print the report's paths.",
    )
    parser.add_argument("--model", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--config", type=Path, default=SEED_WORKLOAD)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    add_store_option(parser)
    parser.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    if not is_built(args.model):
        with console.status(f"building the tiny model in {args.model}"):
            make_tiny_model(args.model)
    store = open_store(args)
    config = load_config(args.config)
    run_id = default_run_id("demo")
    server = VllmServer(args.model, profile="default", port=args.port)
    try:
        with console.status(
            f"starting vLLM on {server.url} (about 80 s on a CPU); log {server.log_path}"
        ):
            server.start()
        console.print(f"vLLM ready after {server.ready_s:.0f} s")
        result = bench.execute(config, server.url, store, run_id=run_id)
    except ServerFailed as exc:
        console.print(f"[red]{exc}")
        return 1
    finally:
        server.stop()
    console.print(f"run {run_id}: {result.events} requests, {result.errors} failed")
    paths = write_report(run_summary(store, run_id), args.out)
    console.print("report:")
    for path in paths:
        print(path.resolve())
    return 1 if result.errors else 0
