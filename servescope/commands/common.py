"""Options and helpers every command shares."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from servescope.store import Store, settings
from servescope.store.lakeread import Lake, NoLake
from servescope.store.paths import name_of
from servescope.wire.slo import BadSlo, parse_slo

# Messages carry run ids, paths and server text: never read as rich markup (a run id `[/]x`
# would raise); colour goes in `style=`.
console = Console(stderr=True, markup=False)


def command_group(
    sub: argparse._SubParsersAction, name: str, help: str, description: str | None = None
) -> argparse._SubParsersAction:
    """A command that is only its subcommands (`servescope model make-tiny`): its parser and
    the required SUBCOMMAND slot (dest `NAME_command`), for the caller to fill."""
    parser = sub.add_parser(name, help=help, description=description)
    return parser.add_subparsers(dest=f"{name}_command", required=True, metavar="SUBCOMMAND")


def add_store_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store",
        type=Path,
        default=None,
        help="DuckDB store file (default: $SERVESCOPE_STORE, else servescope.duckdb in the data "
        "folder, $SERVESCOPE_DATA_DIR or ./servescope-data)",
    )


def add_lake_option(parser: argparse.ArgumentParser) -> None:
    """`--lake`: read a shared Parquet lake in place of the store (reading commands only)."""
    parser.add_argument(
        "--lake",
        action="append",
        default=None,
        metavar="DIR",
        help="read the shared Parquet lake that `servescope collect --lake` writes, in place "
        "(no import), instead of the store: a folder or a quoted glob of folders; repeatable",
    )


def store_command(
    parser: argparse.ArgumentParser,
    func: Callable[[argparse.Namespace], int],
    *,
    json_help: str | None = None,
    lake: bool = False,
) -> None:
    """What every command that opens the store ends with: `--json` (saying what it prints) when
    it has one, `--store`, `--lake` when it only reads, and the function it runs."""
    if json_help is not None:
        parser.add_argument("--json", action="store_true", help=json_help)
    add_store_option(parser)
    if lake:
        add_lake_option(parser)
    parser.set_defaults(func=func)


class UsageError(Exception):
    """Bad usage or unknown input: the message is printed as it is, and the exit code is 2."""


def open_store(args: argparse.Namespace, *, create: bool = False) -> Store:
    """The store of `--store`. A command that only reads refuses a path with no store: a typo
    would otherwise create an empty store and report nothing, with exit 0."""
    if not create and getattr(args, "lake", None):
        if args.store:
            raise UsageError("give --store or --lake, not both")
        try:
            return Lake(args.lake)
        except NoLake as exc:
            raise UsageError(str(exc)) from None
    path = Path(args.store) if args.store else settings.store_path()
    if not create and not path.exists():
        raise UsageError(
            f"no store at {path}: point --store (or $SERVESCOPE_STORE) at one, or make one with "
            "`servescope store import` or `servescope collect`"
        )
    return Store(path)


def add_window_options(parser: argparse.ArgumentParser, what: str = "RUN") -> None:
    """`--since`/`--until`: a window of a long-lived run (see reports.windows)."""
    parser.add_argument(
        "--since",
        metavar="TIME",
        help=f"{what} from this time on: ISO (2026-11-24T20:00:00Z), a duration ago (2h, 30m), "
        "or from the run's start or end (start+1h, end-30m)",
    )
    parser.add_argument("--until", metavar="TIME", help=f"{what} up to this time")


def slo_arg(text: str) -> dict[str, float]:
    """`--slo ttft_ms=500,tpot_ms=50` as argparse reads it: a bad bound is a usage error that
    names the known metrics (wire/slo.py)."""
    try:
        return parse_slo(text)
    except BadSlo as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_slo_option(parser: argparse.ArgumentParser, metavar: str, what: str) -> None:
    """`--slo`: goodput bounds in ms, parsed once, by argparse, for every command alike."""
    parser.add_argument("--slo", type=slo_arg, default={}, metavar=metavar, help=what)


def run_arg(store: Store, text: str) -> str:
    """The run a RUN argument names: the run id itself, or — for an id that cannot be typed
    (a NUL byte) — its folder name as reports write it (`store.paths.safe_name`)."""
    if store.has_run(text):
        return text
    decoded = name_of(text)
    if decoded is not None and decoded != text and store.has_run(decoded):
        return decoded
    return text


def byte_progress(label: str) -> Progress:
    """A transient bar of bytes read, for commands that read files."""
    return Progress(
        TextColumn(label, markup=False),
        BarColumn(),
        DownloadColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


def list_runs(args: argparse.Namespace) -> int:
    """`store runs` and `report list`: every run with its event counts, flips and levers."""
    store = open_store(args)
    runs = store.runs()
    if args.json:
        print(json.dumps(runs, default=str))
        return 0
    table = Table(title=f"runs in {store.path}")
    counts = ("events", "ok", "errors", "rejected", "flips")
    for column in ("run", *counts, "started (UTC)", "model", "status", "levers"):
        table.add_column(column, justify="right" if column in counts else "left")
    for run in runs:
        levers = "\n".join(
            f"{k}={v if isinstance(v, str) else json.dumps(v)}"
            for k, v in (run["levers"] or {}).items()
        )
        started = run["started_at"]
        cells = (
            run["run_id"],
            *(run["events"], run["ok"], run["errors"], run["rejected"], run["flips"]),
            started.isoformat(" ", "seconds") if started else "",
            run["model"] or "",
            run["status"] or "",
            levers or "n/a",
        )
        table.add_row(*(Text(str(c)) for c in cells))  # Text: no markup from stored strings
    # piped output is not cut at 80 columns: a script or a reviewer gets every lever
    Console(width=None if sys.stdout.isatty() else 200).print(table)
    return 0


def _interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def sigterm_as_ctrl_c() -> None:
    """SIGTERM stops a long command as Ctrl-C does: the servers it started are stopped and what
    it measured is kept (a plain SIGTERM would end Python without its `finally` blocks)."""
    signal.signal(signal.SIGTERM, _interrupt)
