"""Which replica of a model's pool serves a request, and why.

A route (`gateway/config.py`) names a pool of upstreams — replicas serving the same model — and
a policy:

- `round-robin`: the pool in turn, skipping replicas that are down.
- `least-outstanding`: the replica with the fewest of this gateway's requests outstanding on it
  (routed and not finished: queued for admission or running); ties go in turn.
- `prefix-affinity`: requests that share a prefix go to the same replica, whose prefix cache
  then holds it, instead of every replica computing and caching every prefix. The key is the
  chat's system message(s) — for a chat without one, its first message — or a completions
  prompt's first `prefix_chars` characters (the first `prefix_chars / 4` ids of a prompt given
  as token ids; about four characters make a token). It is hashed onto a consistent-hash ring
  (64 points per replica), so adding or removing a replica moves only the prefixes that lived
  on it. With nothing to hash the request goes to the least-outstanding replica (`no-prefix`).

The bounded-load rule (consistent hashing with bounded loads, Mirrokni, Thorup and
Zadimoghaddam 2017): with `n` replicas up, `L` requests outstanding on them and the route's
`load_factor` `c` (default 1.25), no replica takes a request that would put it above
`ceil(c × (L + 1) / n)` outstanding. The walk starts at the key's point on the ring and takes
the first replica that is up and under that bound. One hot prefix therefore fills its home
replica only up to 1.25 × the mean load, and its overflow goes to the next replica on the ring —
always the same one, so the overflow is cached in one more place, not everywhere. The bounds
add up to more than `L`, so some replica is always under its bound.

Every choice has a reason, written into the request's event (`route_reason`), the response's
`X-Servescope-Route` header, and `servescope_gateway_route_decisions_total{model, upstream,
reason}` (one per attempt):

| reason | the replica was chosen because |
|---|---|
| `only` | the route has a single upstream |
| `round-robin` | it was its turn |
| `least-outstanding` | it had the fewest outstanding requests |
| `prefix-home` | it is the prefix's home on the ring |
| `prefix-spill` | the replicas before it on the ring were at the load bound |
| `prefix-failover` | the prefix's home is down |
| `no-prefix` | prefix-affinity had nothing to hash: the least-outstanding replica |
| `retry` | the replica chosen before it failed before sending a byte |
| `fallback` | the pool failed before sending a byte: the route's fallback |

Health is the gateway's (`gateway/health.py`): a replica that refuses a connection, drops a
stream or fails its `/health` probe is down and skipped (tried last); a probe that answers 200
brings it back by itself.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from servescope.gateway.config import Route

VNODES = 64  # ring points per replica: a replica's share of the keys within a few % of 1/n
CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class Pick:
    """One upstream to try, and why it is tried."""

    upstream: str
    reason: str


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def _text(content: Any) -> str:
    """A chat message's text: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def affinity_key(body: dict[str, Any], chat: bool, prefix_chars: int) -> bytes | None:
    """What prefix-affinity hashes: the chat's system message(s) (else its first message), or
    a completions prompt's leading characters; None when the request has neither."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        system = [
            _text(m.get("content"))
            for m in messages
            if isinstance(m, dict) and m.get("role") in ("system", "developer")
        ]
        if system:
            text = "\n".join(system)
        else:
            first = messages[0]
            text = _text(first.get("content"))[:prefix_chars] if isinstance(first, dict) else ""
        return text.encode() if text else None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch: its first prompt
    if isinstance(prompt, str):
        return prompt[:prefix_chars].encode() or None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt[:8]):
        ids = prompt[: max(1, prefix_chars // CHARS_PER_TOKEN)]
        return b"ids:" + ",".join(str(t) for t in ids).encode()
    return None


class HashRing:
    """A consistent-hash ring over replica names (`VNODES` points each)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        points = sorted(
            (_point(f"{name}#{i}".encode()), name) for name in names for i in range(VNODES)
        )
        self._hashes = [h for h, _ in points]
        self._names = [n for _, n in points]
        self.size = len(names)

    def walk(self, key: bytes) -> list[str]:
        """Every replica once, clockwise from the key's point: its home first."""
        start = bisect.bisect(self._hashes, _point(key))
        order: list[str] = []
        for i in range(len(self._names)):
            name = self._names[(start + i) % len(self._names)]
            if name not in order:
                order.append(name)
                if len(order) == self.size:
                    break
        return order


class Router:
    """The routing state of one gateway: turns, rings, and requests outstanding per replica.

    `outstanding` counts this gateway's requests routed to a replica and not finished (queued
    for admission included), which is what least-outstanding and the load bound compare: a burst
    of arrivals is spread at once instead of all seeing the same idle replica.
    """

    def __init__(self) -> None:
        self.outstanding: dict[str, int] = {}
        self._turns: dict[str, int] = {}
        self._rings: dict[tuple[str, ...], HashRing] = {}

    def hold(self, upstream: str) -> None:
        self.outstanding[upstream] = self.outstanding.get(upstream, 0) + 1

    def let_go(self, upstream: str) -> None:
        self.outstanding[upstream] -= 1

    def plan(
        self,
        route: Route,
        body: dict[str, Any],
        chat: bool,
        usable: Callable[[str], bool],
    ) -> list[Pick]:
        """The upstreams to try, in order: the policy's choice among the replicas that are up,
        the pool's other replicas that are up (`retry`), the fallback, then the replicas that
        are down (`retry`: tried last rather than failing the request). With nothing up, the
        whole pool is ordered as if it were."""
        pool = route.pool
        if len(pool) == 1:
            picks = [Pick(pool[0], "only")]
        else:
            up = [n for n in pool if usable(n)]
            first, reason = self._choose(route, up or list(pool), body, chat, set(pool) - set(up))
            rest = [n for n in (up or pool) if n != first]
            picks = [Pick(first, reason), *(Pick(n, "retry") for n in rest)]
        if route.fallback is not None:
            picks.append(Pick(route.fallback, "fallback"))
        down = [n for n in pool if n not in {p.upstream for p in picks}]
        picks += [Pick(n, "retry") for n in down]
        if not usable(picks[0].upstream):  # today's rule: whatever is up goes first
            picks.sort(key=lambda p: not usable(p.upstream))
        return picks

    def _choose(
        self, route: Route, up: list[str], body: dict[str, Any], chat: bool, down: set[str]
    ) -> tuple[str, str]:
        if route.routing == "round-robin":
            return self._in_turn(route.model, up), "round-robin"
        if route.routing == "least-outstanding":
            return self._least(route.model, up), "least-outstanding"
        key = affinity_key(body, chat, route.prefix_chars)
        if key is None:
            return self._least(route.model, up), "no-prefix"
        ring = self._rings.get(route.pool)
        if ring is None:
            ring = self._rings[route.pool] = HashRing(route.pool)
        load = sum(self.outstanding.get(n, 0) for n in up)
        bound = math.ceil(route.load_factor * (load + 1) / len(up))
        walk = ring.walk(key)
        home_down = walk[0] in down
        for i, name in enumerate(walk):
            if name in down:
                continue
            if self.outstanding.get(name, 0) + 1 <= bound:
                if i == 0:
                    return name, "prefix-home"
                return name, "prefix-failover" if home_down else "prefix-spill"
        return self._least(route.model, up), "prefix-spill"  # unreachable: the bounds add up

    def _in_turn(self, model: str, names: list[str]) -> str:
        turn = self._turns.get(model, 0)
        self._turns[model] = turn + 1
        return names[turn % len(names)]

    def _least(self, model: str, names: list[str]) -> str:
        fewest = min(self.outstanding.get(n, 0) for n in names)
        tied = [n for n in names if self.outstanding.get(n, 0) == fewest]
        return tied[0] if len(tied) == 1 else self._in_turn(model, tied)


def routing_changes(old: dict[str, Route], new: dict[str, Route]) -> list[tuple[str, str, str]]:
    """(model, policy before, policy after) for every pooled model whose policy a reload
    changes: the `routing` lever flips the gateway records."""
    return [
        (model, old[model].routing, route.routing)
        for model, route in sorted(new.items())
        if model in old
        and max(len(route.pool), len(old[model].pool)) > 1
        and old[model].routing != route.routing
    ]
