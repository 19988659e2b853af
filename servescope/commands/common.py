"""Options and helpers every command shares."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from store import Store
from store.paths import name_of

console = Console(stderr=True)


def add_store_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store",
        type=Path,
        default=None,
        help="DuckDB store file "
        "(default: $SERVESCOPE_STORE or ./servescope-data/servescope.duckdb)",
    )


def open_store(args: argparse.Namespace) -> Store:
    return Store(args.store)


def run_arg(store: Store, text: str) -> str:
    """The run a RUN argument names: the run id itself, or — for an id that cannot be typed
    (a NUL byte) — its folder name as reports write it (`store.paths.safe_name`)."""
    if store.has_run(text):
        return text
    decoded = name_of(text)
    if decoded is not None and decoded != text and store.has_run(decoded):
        return decoded
    return text
