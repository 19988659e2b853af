"""One module per command group; each has `register(subparsers)`."""

from servescope.commands import bench, demo, model, report, serve, store

COMMANDS = [model, serve, bench, store, report, demo]
