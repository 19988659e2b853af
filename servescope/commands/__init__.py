"""One module per command group; each has `register(subparsers)`.

Nothing is imported with this package: `modules_for(argv)` imports only the module of the
command typed (each group's imports reach different rooms, and all of them together take seconds
that a `store runs` should not pay); help and unknown commands import them all.
"""

from collections.abc import Sequence
from importlib import import_module
from types import ModuleType

NAMES = [
    "model",
    "serve",
    "bench",
    "collect",
    "experiment",
    "store",
    "report",
    "demo",
    "gateway",
    "dashboards",
    "capacity",
    "diagnose",
]


def modules_for(argv: Sequence[str]) -> list[ModuleType]:
    """The command modules a parser for `argv` needs: the typed command's alone, or every one
    when none is typed (`--help`, a typo) so that argparse lists them all."""
    typed = next((arg for arg in argv if not arg.startswith("-")), None)
    names = [typed] if typed in NAMES else NAMES
    return [import_module(f"{__name__}.{name}") for name in names]
