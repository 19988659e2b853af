"""`servescope store`: import, export and list what the store holds."""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

from servescope.commands.common import (
    UsageError,
    byte_progress,
    command_group,
    console,
    list_runs,
    open_store,
    run_arg,
    store_command,
)
from servescope.store import export_run, import_file, retention
from servescope.store.clock import utcnow
from servescope.store.parquet import count_parquet, export_parquet


def register(sub: argparse._SubParsersAction) -> None:
    stores = command_group(
        sub,
        "store",
        help="import, export and list runs in the DuckDB store",
        description="The DuckDB store every command reads: one file (--store, $SERVESCOPE_STORE, "
        "default servescope-data/servescope.duckdb). Import .events.jsonl files (bad lines go to "
        "the ingest_errors table with a reason), export a run back as .events.jsonl or every run "
        "as Parquet, list the runs. Exit codes: 0 done, 1 the store or a file cannot be read or "
        "written, 2 bad usage or an unknown run.",
    )

    imp = stores.add_parser(
        "import",
        help="import .events.jsonl files (idempotent)",
        description="Import request records; a record already stored (same run and request_id) "
        "is merged, never duplicated. Bad lines go to ingest_errors with a reason.",
    )
    imp.add_argument("files", nargs="+", type=Path)
    store_command(imp, run_import, json_help="print the totals as JSON")

    exp = stores.add_parser(
        "export",
        help="export a run as .events.jsonl (records as imported), or runs as Parquet",
        description="jsonl: the run's request records and agent-runtime events, line for line "
        "as imported, in their file's order. parquet: hive-partitioned files "
        "OUT/{events,runtime_events}/run_id=…/date=…/ for DuckDB, ClickHouse or Spark "
        "(every run when RUN is left out).",
    )
    exp.add_argument("run_id", nargs="?", metavar="RUN", help="the run (required for jsonl)")
    exp.add_argument("--out", type=Path, required=True, help="a file (jsonl) or folder (parquet)")
    exp.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    store_command(exp, run_export, json_help="print the counts as JSON")

    runs = stores.add_parser("runs", help="list runs with their event counts (as `report list`)")
    store_command(runs, list_runs, json_help="print the runs as JSON", lake=True)

    prune = stores.add_parser(
        "prune",
        help="drop /metrics samples older than a date, downsample those older than a day",
        description="What `servescope collect --retain` does, once: /metrics samples older than "
        "--before are dropped; those from --before to 24 hours ago are downsampled to one a "
        "minute per series (target, name, labels, run), the minute's last sample kept as it is "
        "(right for counters' rate(); a gauge keeps its closing value). Samples of the last 24 "
        "hours, requests, runs, lever flips, runtime events and ingest errors are kept. Runs in "
        "short transactions, so a collector writing the same store goes on; the file keeps its "
        "size (DuckDB reuses the space).",
    )
    prune.add_argument(
        "--before",
        required=True,
        metavar="DATE",
        help="drop samples older than this: an ISO date or date and time, UTC unless it says "
        "otherwise (2026-11-13, 2026-11-13T06:00:00Z)",
    )
    prune.add_argument(
        "--dry-run", action="store_true", help="count what would be dropped and downsampled"
    )
    store_command(prune, run_prune, json_help="print the counts as JSON")


def run_import(args: argparse.Namespace) -> int:
    store = open_store(args, create=True)
    events = runtime_events = errors = 0
    runs: set[str] = set()
    for path in args.files:
        if not path.is_file():
            console.print(f"no such file: {path}", style="red")
            return 2
        with byte_progress(f"importing {path.name}") as progress:
            task = progress.add_task("import", total=path.stat().st_size or 1)
            result = import_file(store, path, on_read=functools.partial(progress.advance, task))
        events += result.events
        errors += result.errors
        runs |= result.runs
        runtime_events += result.runtime_events
        console.print(
            f"{path}: {result.events} records, {result.runtime_events} runtime events, "
            f"{result.errors} quarantined"
        )
        for offset, reason in result.examples:
            console.print(f"  byte {offset}: {reason}", style="yellow")
        if result.errors > len(result.examples):
            console.print("  … every refused line is in the store's ingest_errors table")
    if args.json:
        print(json.dumps({"events": events, "runtime_events": runtime_events, "errors": errors,
                          "runs": sorted(runs)}))  # fmt: skip
    return 0


def run_export(args: argparse.Namespace) -> int:
    store = open_store(args)
    run_id = None if args.run_id is None else run_arg(store, args.run_id)
    if run_id is not None and not store.has_run(run_id):
        console.print(
            f"unknown run {run_id!r}; known runs: {', '.join(store.run_ids()) or 'none'}",
            style="red",
        )
        return 2
    if args.format == "parquet":
        written = export_parquet(store, args.out, run_id)
        read_back = {table: count_parquet(args.out / table) for table in written}
        for table, rows in written.items():
            console.print(f"{rows} {table} rows written to {args.out / table}")
        if args.json:
            print(json.dumps({"written": written, "read_back": read_back}))
        return 0 if read_back == written else 1
    if run_id is None:
        console.print("jsonl export needs a RUN (see `servescope store runs`)", style="red")
        return 2
    count = export_run(store, run_id, args.out)
    console.print(f"{count} records written to {args.out}")
    if args.json:
        print(json.dumps({"written": {"lines": count}}))
    return 0


def run_prune(args: argparse.Namespace) -> int:
    try:
        before = retention.parse_before(args.before)
    except retention.BadRetention as exc:
        raise UsageError(f"--before: {exc}") from None
    now = utcnow()
    if before > now:
        raise UsageError(f"--before {args.before}: that is in the future; nothing would be kept")
    store = open_store(args)
    samples_before = retention.sample_count(store)
    started = time.monotonic()
    result = retention.prune(store, before, now=now, dry_run=args.dry_run)
    seconds = round(time.monotonic() - started, 3)
    samples_after = retention.sample_count(store)
    would = "would be " if args.dry_run else ""
    console.print(f"{result.dropped} metric samples older than {before:%F %T} UTC {would}dropped")
    if result.downsample_from is not None and result.downsample_until is not None:
        console.print(
            f"{result.downsampled} {would}removed by downsampling {result.downsample_from:%F %T}"
            f" to {result.downsample_until:%F %T} UTC to one sample a minute per series"
        )
    else:
        console.print("nothing to downsample: --before is within the last 24 hours")
    console.print(f"metric samples: {samples_before} before, {samples_after} after ({seconds} s)")
    if args.json:
        out = result.as_json() | {
            "samples_before": samples_before, "samples_after": samples_after, "seconds": seconds
        }  # fmt: skip
        print(json.dumps(out))
    return 0
