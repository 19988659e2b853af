"""Options and helpers every command shares."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from store import Store

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
