"""One module per command group; each has `register(subparsers)`.

The modules are imported when `COMMANDS` is first read (building the `servescope` parser), not
when this package is: the `report` script imports only its own module, and skips the second
that the vLLM-side modules take to import.
"""

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


def __getattr__(name: str) -> list[ModuleType]:
    if name == "COMMANDS":
        return [import_module(f"{__name__}.{module}") for module in NAMES]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
