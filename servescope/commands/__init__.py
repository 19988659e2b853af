"""One module per command group; each has `register(subparsers)`."""

from servescope.commands import bench, dashboards, demo, gateway, model, report, serve, store

COMMANDS = [model, serve, bench, store, report, demo, gateway, dashboards]
