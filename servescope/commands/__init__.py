"""One module per command group; each has `register(subparsers)`."""

from servescope.commands import (
    bench,
    collect,
    dashboards,
    demo,
    experiment,
    gateway,
    model,
    report,
    serve,
    store,
)

COMMANDS = [model, serve, bench, collect, experiment, store, report, demo, gateway, dashboards]
