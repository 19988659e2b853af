"""`servescope`: thin commands that wire the rooms together.

Exit codes: 0 success, 1 the work ran and failed (a run with errors, a server that died, a
store or file that cannot be read or written), 2 bad usage or unknown input (an unknown run, an
unreadable workload file), 130 interrupted. No input ends in a Python traceback: an error no
command expected is printed on one line with exit code 70 (`SERVESCOPE_DEBUG=1` shows the
traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from servescope import commands

INTERNAL_ERROR = 70  # sysexits' EX_SOFTWARE


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The `servescope` parser for `argv` (default: every command's)."""
    parser = argparse.ArgumentParser(
        prog="servescope",
        description="Measure what each vLLM lever flip does to TTFT, TPOT, queue time, "
        "prefix-cache hits and errors.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in commands.modules_for([] if argv is None else argv):
        module.register(sub)
    return parser


def guarded(func: Callable[[argparse.Namespace], int | None], args: argparse.Namespace) -> int:
    """Run a command; what escapes it is one line on stderr and an exit code, not a traceback."""
    import duckdb

    from servescope.commands.common import UsageError
    from servescope.store import StoreBusy

    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "servescope"
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if os.environ.get("SERVESCOPE_DEBUG"):
            raise
        if isinstance(exc, UsageError):
            print(f"{prog}: {exc}", file=sys.stderr)
            return 2
        if isinstance(exc, StoreBusy | duckdb.Error):
            print(f"{prog}: the store cannot be used: {exc}", file=sys.stderr)
            return 1
        if isinstance(exc, OSError):
            print(f"{prog}: {exc.strerror or exc}: {exc.filename or ''}", file=sys.stderr)
            return 1
        print(
            f"{prog}: internal error ({type(exc).__name__}: {exc}); SERVESCOPE_DEBUG=1 shows where",
            file=sys.stderr,
        )
        return INTERNAL_ERROR


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    return guarded(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
