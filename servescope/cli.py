"""`servescope` and `report`: thin commands that wire the rooms together.

Exit codes: 0 success, 1 the work ran and failed (a run with errors, a server that died),
2 bad usage or unknown input (an unknown run, an unreadable workload file).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from servescope import commands
from servescope.commands import report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="servescope",
        description="Measure what each vLLM lever flip does to TTFT, TPOT, queue time, "
        "prefix-cache hits and errors.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in commands.COMMANDS:
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


def report_main(argv: Sequence[str] | None = None) -> int:
    """The `report` console script: `report build run-20260512` is `servescope report build …`."""
    parser = argparse.ArgumentParser(prog="report", description=report.DESCRIPTION)
    report.add_subcommands(parser)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
