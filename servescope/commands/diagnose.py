"""`servescope diagnose RUN`: the lever to flip first, and why (reports/diagnosis.yaml)."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table
from rich.text import Text

from servescope.commands.common import (
    add_slo_option,
    add_window_options,
    console,
    open_store,
    store_command,
)
from servescope.reports import BadWindow, ReportOptions, UnknownRun, Window, build_summary
from servescope.reports.diagnosed import Diagnosis, OfferedLever
from servescope.store.lakeread import Lake

DESCRIPTION = (
    "Read a stored run's indicators and say what to flip first: the workload's shape (chat, "
    "batch, rag, agent, mixed), each finding of the vLLM tuning matrix that holds (symptom: "
    "queue, prefill, decode, streaming, memory, api or cache; the evidence with the run's "
    "numbers; vLLM levers in order; why; the servescope experiment that tests it), levers not "
    "recommended because the run already has them, and what could not be judged. The rules "
    "are data: reports/diagnosis.yaml. The same diagnosis is in every run report. Exit codes: "
    "0 done (with or without findings), 2 an unknown run, a bad window or bad options."
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("diagnose", help="what to flip first, from a run's indicators",
                       description=DESCRIPTION)  # fmt: skip
    p.add_argument("run_id", metavar="RUN", help="a run id (`servescope report list` lists them)")
    add_slo_option(
        p,
        "ttft_ms=…,tpot_ms=…",
        "targets in ms (default: the run's recorded SLOs, else the rules')",
    )
    add_window_options(p, "diagnose RUN")
    store_command(p, run, json_help="print the diagnosis as JSON", lake=True)


def run(args: argparse.Namespace) -> int:
    store = open_store(args)
    if isinstance(store, Lake) and store.has_run(args.run_id):  # its partitions alone
        store = store.scoped([args.run_id])
    try:
        options = ReportOptions(slo=args.slo, charts=False)
        report = build_summary(store, args.run_id, options, Window(args.since, args.until))
    except (UnknownRun, BadWindow) as exc:
        console.print(str(exc), style="red")
        return 2
    diagnosis = report["diagnosis"]
    if args.json:
        out = {"run_id": args.run_id, "window": report.get("window"), **diagnosis}
        print(json.dumps(out, indent=2, default=str))
        return 0
    _print(args.run_id, diagnosis)
    return 0


def _levers(levers: list[OfferedLever]) -> str:
    parts = []
    for lever in levers:
        how = f" → {lever['want']}" if lever["want"] is not None else f" ({lever['direction']})"
        parts.append(lever["lever"] + how)
    return "\n".join(parts)


def _print(run_id: str, d: Diagnosis) -> None:
    out = Console(width=120, soft_wrap=False)
    shape = d["workload_shape"]
    out.print(Text(f"{run_id}: workload shape {shape['shape']} — {shape['why']}"))
    if not d["findings"]:
        out.print("No recommendation: none of the rules' symptoms shows in this run.")
    else:
        table = Table(show_lines=True)
        for column in ("#", "symptom", "finding", "evidence (this run)", "levers, in order",
                       "experiment"):  # fmt: skip
            table.add_column(column, no_wrap=column == "levers, in order")
        for i, f in enumerate(d["findings"], 1):
            cells = (str(i), f["symptom"], f["title"], "\n".join(f["evidence"]),
                     _levers(f["levers"]), f["experiment"] or "none yet")  # fmt: skip
            table.add_row(*(Text(c) for c in cells))
        out.print(table)
        first = d["findings"][0]
        out.print(Text(f"First: {first['levers'][0]['lever']} — {first['why']}"))
    for held in d["already_set"]:
        have = ", ".join(f"{lever['lever']}={lever['value']}" for lever in held["levers"])
        out.print(Text(f"already set ({held['rule']}): {have}"))
    for skipped in d["not_judged"]:
        out.print(Text(f"not judged: {skipped['rule']} ({skipped['reason']})"))
