"""One module per command group; each has `register(subparsers)`."""

from servescope.commands import (
    bench,
    dashboards,
    demo,
    experiment,
    gateway,
    model,
    report,
    serve,
    store,
)

COMMANDS = [model, serve, bench, experiment, store, report, demo, gateway, dashboards]
