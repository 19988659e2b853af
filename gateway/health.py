"""Which upstreams the gateway uses: an upstream that fails is skipped for a while, and the
replicas of a pool are probed so that a dead one is skipped even with no traffic to it.

An upstream is down for `DOWN_FOR_S` after it refused a connection, dropped a stream it had
started or failed its `/health` probe, and is then tried again by itself; a probe answered 200
brings it back at once. Routes of a single upstream keep the passive rule alone: probing them
would only repeat what their own requests find out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

import aiohttp

from servescope.gateway.config import GatewayConfig

DOWN_FOR_S = 2.0
PROBE_EVERY_S = 0.5
PROBE_TIMEOUT_S = 5.0


class UpstreamHealth:
    """Down marks by upstream name. Names outlive config reloads: a replica that a reload keeps
    keeps its mark."""

    __slots__ = ("_down_until",)

    def __init__(self) -> None:
        self._down_until: dict[str, float] = {}

    def usable(self, name: str, now: float) -> bool:
        """Whether `name` is up at `now` (`time.monotonic()`)."""
        return now >= self._down_until.get(name, 0.0)

    def usable_now(self) -> Callable[[str], bool]:
        """`usable` at one instant, for a routing decision that asks about several upstreams."""
        now = time.monotonic()
        down_until = self._down_until
        return lambda name: now >= down_until.get(name, 0.0)

    def up(self, name: str) -> float:
        """1 while `name` is used, 0 while it is skipped (`servescope_gateway_upstream_up`)."""
        return float(self.usable(name, time.monotonic()))

    def mark_down(self, name: str) -> None:
        """Skip `name` for `DOWN_FOR_S`; it is tried again after that by itself."""
        self._down_until[name] = time.monotonic() + DOWN_FOR_S

    def mark_up(self, name: str) -> None:
        self._down_until[name] = 0.0

    def states(self, names: Iterable[str]) -> dict[str, str]:
        """`up` or `down` for each name, as `/health` reports them."""
        usable = self.usable_now()
        return {name: "up" if usable(name) else "down" for name in names}

    async def probe_pools(
        self, session: aiohttp.ClientSession, config: Callable[[], GatewayConfig]
    ) -> None:
        """Every `PROBE_EVERY_S`, `GET /health` on each replica of a pool of the config running
        then (`config()`, which a reload swaps). Each replica keeps its own pace: a busy one slow
        to answer never delays the probe that finds another one dead. Runs until cancelled."""
        probing: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                running = config()
                names = {n for r in running.routes.values() if len(r.pool) > 1 for n in r.pool}
                for name in sorted(names):
                    upstream = running.upstreams.get(name)
                    if upstream is not None and (name not in probing or probing[name].done()):
                        probing[name] = asyncio.create_task(
                            self._probe(session, name, upstream.url)
                        )
                await asyncio.sleep(PROBE_EVERY_S)
        finally:
            for task in probing.values():
                task.cancel()

    async def _probe(self, session: aiohttp.ClientSession, name: str, url: str) -> None:
        try:
            async with session.get(
                f"{url}/health", timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
            ) as resp:
                healthy = resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            healthy = False
        if healthy:
            self.mark_up(name)
        else:
            self.mark_down(name)
