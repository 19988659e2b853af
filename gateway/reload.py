"""SIGHUP: gateway.yaml read again and swapped in whole, and each routing policy it changes
recorded as a lever flip.

In-flight requests keep the config they arrived under; new limits apply from the next
admission. A file that does not validate changes nothing: the running config stays, and the
refusal is logged and counted (`servescope_gateway_config_reloads_total{outcome="error"}`).
The listen address is the one thing a reload cannot change (the socket is already bound).

A routing policy is a lever: a reload that changes a pooled model's policy is a `lever_flips`
row (lever `routing`), which reports split a run on. The store may be busy with another writer,
so the rows are written on a thread, off the event loop: a slow store delays a note, never a
request.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import duckdb
from prometheus_client import Counter

from servescope.gateway.config import GatewayConfig, load_config
from servescope.gateway.routing import routing_changes
from servescope.store import Store

log = logging.getLogger("servescope.gateway")


class Reloader:
    """Reloads of one gateway.yaml, and the lever flips they write into `store`."""

    def __init__(self, path: Path | None, store: Store | None, outcomes: Counter) -> None:
        self.path = path
        self.store = store
        self._outcomes = outcomes
        self._writers: list[threading.Thread] = []

    def reload(self, running: GatewayConfig, apply: Callable[[GatewayConfig], None]) -> bool:
        """Read the file again and `apply` it when it validates; whether it was applied."""
        if self.path is None:
            return False
        try:
            config = load_config(self.path)
        except ValueError as exc:
            self._outcomes.labels("error").inc()
            log.error("reload refused, keeping the running config: %s", exc)
            return False
        if (config.host, config.port) != (running.host, running.port):
            log.warning(
                "listen address changes need a restart; keeping %s:%s", running.host, running.port
            )
        changes = routing_changes(running.routes, config.routes)
        apply(config)
        self._outcomes.labels("ok").inc()
        log.info(
            "reloaded %s: %d teams, %d upstreams, %d models",
            config.source,
            len(config.teams),
            len(config.upstreams),
            len(config.routes),
        )
        if changes:
            self._record_flips(changes, config.source)
        return True

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait for the lever flips being written (a gateway stopped right after a reload)."""
        for thread in self._writers:
            thread.join(timeout_s)
        self._writers = [t for t in self._writers if t.is_alive()]

    def _record_flips(self, changes: list[tuple[str, str, str]], source: str) -> None:
        for model, before, after in changes:
            log.info("routing of %s: %s -> %s", model, before, after)
        if self.store is None:
            return
        store = self.store

        def write() -> None:
            try:
                for model, before, after in changes:
                    store.add_lever_flip(
                        "routing", before, after, note=f"gateway reload of {source}: {model}"
                    )
            except (duckdb.Error, OSError) as exc:  # a store not written loses a note, not requests
                log.error("could not record the routing flip in %s: %r", store.path, exc)

        thread = threading.Thread(target=write, name="routing-flip", daemon=True)
        thread.start()
        self._writers.append(thread)
