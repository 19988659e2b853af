"""The admission decision made before every request: admit now, queue, or reject.

Scheduling, when a slot frees:
- strict priority between classes (a waiting request of a higher `priority` always goes first);
- weighted fair queueing between teams of one class, by stride: each admission adds
  1/weight to the team's pass, and the eligible team with the lowest pass goes next;
- FIFO within a team.

A team counts only its own `max_concurrent` and `max_queue` against itself, and a team at its
own concurrency limit is not eligible, so its waiting requests are skipped over instead of
blocking anyone: a team over its limit never delays another team. The only shared resource is
each upstream's global cap, divided by the rules above.

The scheduler is plain asyncio (one event loop, no locks) and knows nothing about HTTP.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field

from servescope.gateway.config import Team


class Rejected(Exception):
    """An admission decision against the request; `reason` is the event's `rejected:<reason>`."""

    STATUS = {
        "queue_full": 429,
        "token_budget": 429,
        "prompt_too_long": 413,
        "queue_timeout": 503,
        "upstream_unavailable": 503,
        "unknown_key": 401,
        "unknown_model": 404,
        "model_not_allowed": 403,
        "bad_request": 400,
    }

    def __init__(self, reason: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry_after_s = retry_after_s

    @property
    def http_status(self) -> int:
        return self.STATUS[self.reason]


@dataclass
class _Waiter:
    team: TeamState
    upstream: str
    future: asyncio.Future[None]


@dataclass
class TeamState:
    """A team's live state; survives config reloads (limits are read from `team` each time)."""

    team: Team
    active: int = 0
    queue: deque[_Waiter] = field(default_factory=deque)
    pass_: float = 0.0
    budget_used: int = 0
    budget_window_start: float = field(default_factory=time.monotonic)

    def budget_left(self, now: float) -> tuple[int | None, float]:
        """(tokens left in the window or None when unlimited, seconds until the window resets)."""
        budget = self.team.token_budget
        if budget is None:
            return None, 0.0
        if now - self.budget_window_start >= budget.window_s:
            self.budget_window_start = now
            self.budget_used = 0
        return budget.tokens - self.budget_used, budget.window_s - (now - self.budget_window_start)

    def budget_used_ratio(self) -> float:
        """0-1 of the token budget used in the current window (0 without a budget)."""
        left, _ = self.budget_left(time.monotonic())
        budget = self.team.token_budget
        return 0.0 if left is None or budget is None else min(1.0, 1 - left / budget.tokens)


@dataclass
class Slot:
    """An admitted request's hold on one team slot and one upstream slot; release exactly once."""

    scheduler: Scheduler
    team: TeamState
    upstream: str
    queue_ms: float
    released: bool = False

    def move_to(self, upstream: str) -> None:
        """Carry the slot to another upstream (fallback), without re-queueing."""
        self.scheduler.inflight[self.upstream] -= 1
        self.scheduler.inflight[upstream] = self.scheduler.inflight.get(upstream, 0) + 1
        self.upstream = upstream

    def charge(self, tokens: int) -> None:
        self.team.budget_used += max(tokens, 0)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.scheduler._release(self)


class Scheduler:
    """Per-team queues in front of per-upstream caps."""

    def __init__(self, teams: dict[str, Team], upstream_caps: dict[str, int]) -> None:
        self.teams: dict[str, TeamState] = {}
        self.caps: dict[str, int] = {}
        self.inflight: dict[str, int] = {}
        self._vtime: dict[int, float] = {}
        self.configure(teams, upstream_caps)

    def configure(self, teams: dict[str, Team], upstream_caps: dict[str, int]) -> None:
        """Apply (re)loaded limits; live counts, queues and budgets are kept."""
        for name, team in teams.items():
            if name in self.teams:
                self.teams[name].team = team
            else:
                self.teams[name] = TeamState(team)
        self.caps = dict(upstream_caps)
        for name in upstream_caps:
            self.inflight.setdefault(name, 0)
        self._dispatch()

    def queue_depth(self, team: str) -> int:
        return len(self.teams[team].queue)

    def running_on(self, upstream: str) -> int:
        """Requests admitted and running on `upstream`."""
        return self.inflight.get(upstream, 0)

    async def admit(self, team_name: str, upstream: str, *, prompt_tokens: int = 0) -> Slot:
        """Wait for a slot under the team's and the upstream's limits, or raise `Rejected`."""
        state = self.teams[team_name]
        team = state.team
        start = time.perf_counter()
        left, reset_s = state.budget_left(time.monotonic())
        if left is not None and left <= prompt_tokens:
            raise Rejected(
                "token_budget",
                f"team {team.name!r} has {max(left, 0)} tokens left of its "
                f"{team.token_budget.tokens if team.token_budget else 0}-token window",
                retry_after_s=reset_s,
            )
        if not state.queue and state.active < team.max_concurrent and self._has_room(upstream):
            return self._grant(state, upstream, start)
        if len(state.queue) >= team.max_queue:
            raise Rejected(
                "queue_full",
                f"team {team.name!r} has {state.active} requests running and "
                f"{len(state.queue)} queued (max_queue {team.max_queue})",
                retry_after_s=1.0,
            )
        waiter = _Waiter(state, upstream, asyncio.get_running_loop().create_future())
        if not state.queue:  # becoming active: no credit for the time it was idle
            state.pass_ = max(state.pass_, self._vtime.get(team.priority, 0.0))
        state.queue.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), team.queue_timeout_s)
        except TimeoutError:
            if not waiter.future.done():
                state.queue.remove(waiter)
                waiter.future.cancel()
                raise Rejected(
                    "queue_timeout",
                    f"no slot for team {team.name!r} within {team.queue_timeout_s:g} s",
                    retry_after_s=max(1.0, team.queue_timeout_s / 2),
                ) from None
        except asyncio.CancelledError:  # the client went away while waiting
            if waiter.future.done() and not waiter.future.cancelled():
                self._release_counts(state, upstream)
                self._dispatch()
            elif waiter in state.queue:
                state.queue.remove(waiter)
                waiter.future.cancel()
            raise
        return Slot(self, state, upstream, (time.perf_counter() - start) * 1000.0)

    def _has_room(self, upstream: str) -> bool:
        return self.inflight.get(upstream, 0) < self.caps.get(upstream, math.inf)

    def _grant(self, state: TeamState, upstream: str, start: float) -> Slot:
        self._take(state, upstream)
        return Slot(self, state, upstream, (time.perf_counter() - start) * 1000.0)

    def _take(self, state: TeamState, upstream: str) -> None:
        state.active += 1
        self.inflight[upstream] = self.inflight.get(upstream, 0) + 1
        state.pass_ += 1.0 / state.team.weight
        self._vtime[state.team.priority] = max(
            self._vtime.get(state.team.priority, 0.0), state.pass_ - 1.0 / state.team.weight
        )

    def _release_counts(self, state: TeamState, upstream: str) -> None:
        state.active -= 1
        self.inflight[upstream] -= 1

    def _release(self, slot: Slot) -> None:
        self._release_counts(slot.team, slot.upstream)
        self._dispatch()

    def _dispatch(self) -> None:
        """Hand free slots to waiters: highest priority, then lowest pass, then FIFO."""
        while True:
            best: TeamState | None = None
            for state in self.teams.values():
                if not state.queue or state.active >= state.team.max_concurrent:
                    continue
                if not self._has_room(state.queue[0].upstream):
                    continue
                if (
                    best is None
                    or state.team.priority > best.team.priority
                    or (state.team.priority == best.team.priority and state.pass_ < best.pass_)
                ):
                    best = state
            if best is None:
                return
            waiter = best.queue.popleft()
            self._take(best, waiter.upstream)
            waiter.future.set_result(None)
