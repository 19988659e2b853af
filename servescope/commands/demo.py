"""`servescope demo`: the whole path on real parts, what `make demo` runs.

The demo is the seeds' first practicum: the `prefix-caching` lever-flip experiment at CPU scale
(a real vLLM with prefix caching off, then a fresh one with it on, the same seeded Ralph-loop
workload against both), stored, and reported before/after.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.text import Text

from servescope.commands import experiment
from servescope.commands.common import add_store_option, console, open_store
from servescope.commands.dashboards import DEFAULT_OUT as DASHBOARDS_OUT
from servescope.dashboards import build as build_dashboards
from servescope.loadgen.experiment import Experiment, load_experiments
from servescope.loadgen.tiny_model import DEFAULT_DIR, is_built, make_tiny_model
from servescope.reports.render import DEFAULT_OUT

DEMO_EXPERIMENT = "prefix-caching"


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "demo",
        help="tiny model → two vLLM profiles → bench → store → before/after reports",
        description="Make the tiny model if absent, run the prefix-caching experiment at CPU "
        "scale (vLLM with prefix caching off, then on; the same seeded Ralph-loop workload "
        "against each; about 5 minutes), store every request, build the reports and the Grafana "
        "dashboards, and print their paths.",
    )
    parser.add_argument("--model", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    add_store_option(parser)
    parser.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    if not is_built(args.model):
        with console.status(f"building the tiny model in {args.model}"):
            make_tiny_model(args.model)
    store = open_store(args, create=True)
    spec = load_experiments()[DEMO_EXPERIMENT]
    console.print(Text.assemble((spec.name, "bold"), f": {spec.description}"))
    result = Experiment(
        spec,
        store=store,
        execute=experiment.execute,
        model=args.model,
        hooks=experiment.hooks(store),
    ).run()
    rows = experiment.outcome_rows(store, result)
    console.print(experiment.outcome_table(rows, console))
    paths = experiment.build_reports(store, result, args.out)
    console.print("reports:")
    for path in paths:
        print(path.resolve())
    built = build_dashboards(DASHBOARDS_OUT)
    console.print("Grafana dashboards (load them as the README's dashboards section says):")
    for path in built.dashboards:
        print(path.resolve())
    if result.status != "complete":
        console.print(f"demo {result.status}: {result.failure or 'interrupted'}", style="red")
        return 1
    return 0
