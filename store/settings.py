"""Where servescope keeps what it writes, and the ports it serves on by default: read here only.

Everything a command leaves behind goes under one data folder: `$SERVESCOPE_DATA_DIR`, else
`servescope-data` in the working directory. `$SERVESCOPE_STORE` moves the store file alone
(a shared store next to per-machine logs). The tiny models live under the data folder too:
`servescope model make-tiny` writes them there and the commands that default to them read them
from there.

The environment is read when a path is asked for, not when this module is imported: a test
session (tests/conftest.py) or a program that sets `SERVESCOPE_DATA_DIR` after importing
servescope still gets its own folder, never the working directory's.

The settings live in the store's room because every room that writes files may import the
store and the store imports nothing of ours: a module in `servescope/` (the CLI) could not be
read by the launcher, the gateway or the reports without an import the contract forbids.
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Callable
from pathlib import Path

DATA_DIR_ENV = "SERVESCOPE_DATA_DIR"
STORE_ENV = "SERVESCOPE_STORE"
# The name a collector gives its host in the server-session run ids it makes (`collect
# --instance`; default: the host name). Set it where the host name is not the host's: a container
# whose host name is its id, new with each container.
INSTANCE_ENV = "SERVESCOPE_INSTANCE"
DEFAULT_DATA_DIR = Path("servescope-data")

# Default ports, all bound to 127.0.0.1 unless configured (docs/architecture.md, "Ports").
HOST = "127.0.0.1"
VLLM_PORT = 8000
GATEWAY_PORT = 8080
OTLP_PORT = 4318  # the collector's OTLP/HTTP trace receiver, where vLLM sends its spans
COLLECTOR_METRICS_PORT = 9469  # the collector's own /metrics (9400 is dcgm-exporter's)


def listening(port: int) -> bool:
    """Whether something accepts connections on this loopback port now (a server that has
    bound its port is up as far as its clients can tell)."""
    try:
        with socket.create_connection((HOST, port), timeout=1):
            return True
    except OSError:
        return False


def free_port() -> int:
    """A loopback port no one listens on now, for a server started next to others (an
    experiment's vLLMs and sidecars, a test's receivers), where a default port may be taken.

    It is drawn at random below the kernel's ephemeral range: a port from that range (what
    binding port 0 gives) is also where every outgoing connection takes its local port, so on a
    busy machine one can take it between this look and the server's bind. The server's bind can
    still lose a race to another server; those that servescope starts check theirs."""
    low, _ = ephemeral_range()
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(FREE_PORTS_FROM, low) if low > FREE_PORTS_FROM else 0
        with socket.socket() as sock:
            try:
                sock.bind((HOST, port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    with socket.socket() as sock:  # every draw taken: the kernel's choice
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


FREE_PORTS_FROM = 20000  # above the ports services are configured on by hand


def ephemeral_range() -> tuple[int, int]:
    """Linux's `net.ipv4.ip_local_port_range` (the kernel's default where it cannot be read)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def instance() -> str:
    """The collector's instance name as given (`$SERVESCOPE_INSTANCE`), else the host name."""
    return os.environ.get(INSTANCE_ENV) or socket.gethostname()


def data_dir() -> Path:
    """The data folder: `$SERVESCOPE_DATA_DIR`, else `./servescope-data`."""
    return Path(os.environ.get(DATA_DIR_ENV) or DEFAULT_DATA_DIR)


def store_path() -> Path:
    """The store file: `$SERVESCOPE_STORE`, else `servescope.duckdb` in the data folder."""
    return Path(os.environ.get(STORE_ENV) or data_dir() / "servescope.duckdb")


def _under_data_dir(name: str, holds: str) -> Callable[[], Path]:
    """A function giving the data folder's `name` folder, as it is when called."""

    def folder() -> Path:
        return data_dir() / name

    folder.__name__ = folder.__qualname__ = f"{name}_dir"
    folder.__doc__ = f"`{name}/` in the data folder: {holds}."
    return folder


events_dir = _under_data_dir("events", "`.events.jsonl` files the load generator and gateway write")
logs_dir = _under_data_dir("logs", "vLLM's logs, for the servers servescope starts")
servers_dir = _under_data_dir("servers", "one state file per running server (`<port>.json`)")
fleet_dir = _under_data_dir("fleet", "a fleet experiment's gateway files, one folder each")
reports_dir = _under_data_dir("reports", "reports, one folder each (index.html, report.md, …)")
dashboards_dir = _under_data_dir("dashboards", "Grafana dashboards and their provisioning")
models_dir = _under_data_dir("models", "the tiny local models, one folder per kind")
