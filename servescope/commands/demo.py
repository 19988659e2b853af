"""`servescope demo`: the whole path on real parts, what `make demo` runs.

The demo is the first lever flip to try: the `prefix-caching` experiment at CPU scale
(two real vLLMs started at once, prefix caching off and on, each with its own collector sidecar;
the same seeded Ralph-loop workload against them in interleaved repeats, A B B A …, each run
starting from an emptied prefix cache, until the stopping rule decides TTFT or the demo's budget
ends), stored, and reported before/after with the repeats pooled.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.text import Text

from servescope.commands import experiment
from servescope.commands.common import console, open_store, sigterm_as_ctrl_c, store_command
from servescope.dashboards import build as build_dashboards
from servescope.loadgen.experiment import Experiment
from servescope.loadgen.rounds import Stopping
from servescope.loadgen.spec import load_experiments
from servescope.loadgen.tiny_model import is_built, make_tiny_model, model_dir
from servescope.reports.sequential import FIRST_LOOK, MARGIN_PCT, MAX_REPEATS
from servescope.store import settings

DEMO_EXPERIMENT = "prefix-caching"
DEMO_BUDGET_S = 180.0  # the rounds' share of the demo: servers and reports take the rest


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "demo",
        help="tiny model → two vLLM profiles → bench → store → before/after reports",
        description="Make the tiny model if absent, run the prefix-caching experiment at CPU "
        "scale (two vLLMs at once, prefix caching off and on; the same seeded Ralph-loop "
        "workload against each in interleaved repeats, A B B A …, the prefix cache reset "
        "before every run, until TTFT is decided; about 4 minutes), store every request, build "
        "the pooled "
        "report (and one per repeat) and the Grafana dashboards, and print their paths.",
    )
    parser.add_argument(
        "--model", type=Path, default=model_dir(), help=f"model dir (default {model_dir()})"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=settings.reports_dir(),
        help="reports folder (default "
        f"{settings.reports_dir()}; the dashboards go to {settings.dashboards_dir()})",
    )
    store_command(parser, run_demo)


def run_demo(args: argparse.Namespace) -> int:
    if not is_built(args.model):
        with console.status(f"building the tiny model in {args.model}"):
            make_tiny_model(args.model)
    store = open_store(args, create=True)
    spec = load_experiments()[DEMO_EXPERIMENT]
    console.print(Text.assemble((spec.name, "bold"), f": {spec.description}"))
    started = time.monotonic()
    stopping = Stopping(FIRST_LOOK, MAX_REPEATS, DEMO_BUDGET_S, MARGIN_PCT)
    demo = Experiment(
        spec,
        store=store,
        execute=experiment.execute,
        model=args.model,
        hooks=experiment.hooks(store, stopping),
        stopping=stopping,
    )
    console.print(experiment.plan_line(demo))
    sigterm_as_ctrl_c()
    result = demo.run()
    reports, _rows = experiment.conclude(store, result, args.out, stopping)
    console.print("reports (pooled first, then one per repeat):")
    for path in reports.paths():
        print(path.resolve())
    built = build_dashboards(settings.dashboards_dir())
    console.print("Grafana dashboards (load them as the README's dashboards section says):")
    for path in built.dashboards:
        print(path.resolve())
    console.print(f"demo done in {time.monotonic() - started:.0f} s")
    if result.status != "complete":
        console.print(f"demo {result.status}: {result.failure or 'interrupted'}", style="red")
        return 1
    return 1 if reports.failures else 0
