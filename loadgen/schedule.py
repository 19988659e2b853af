"""When a benchmark run sends what: the load levels in order (or side by side with `together:
true`), the warm-up, and within a level a closed loop (`concurrency` workers, each sending its
next unit when the last is answered) or an open loop (units sent at their seeded arrival times
whatever the server does). An agent session's turns go one after another, each quoting the real
output of the turn before.

Prompts are made before a level starts (or, for a level that runs for a duration, before each
unit is sent), so tokenizer round trips never sit inside a measured interval. What comes back
goes to the recorder (`loadgen/record.py`).
"""

from __future__ import annotations

import asyncio
import os
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field

import aiohttp

from servescope.loadgen.client import stream_request
from servescope.loadgen.plan import Unit, open_loop_units, unit_plan, units_per_level, warmup_units
from servescope.loadgen.prompts import PromptBook
from servescope.loadgen.record import LevelRecord, Recorder
from servescope.loadgen.request import Message, RequestBody
from servescope.loadgen.transport import Http1Pool
from servescope.loadgen.workload import BenchConfig, Workload
from servescope.wire.stream import ENDPOINTS, Endpoint
from servescope.wire.tracing import Tracer


def team_headers(team: str | None) -> dict[str, str]:
    """A team's gateway API key, from `$SERVESCOPE_KEY_<TEAM>` (team `flood-a` reads
    `SERVESCOPE_KEY_FLOOD_A`): keys never live in workload files, events or the store."""
    if not team:
        return {}
    key = os.environ.get("SERVESCOPE_KEY_" + re.sub(r"[^A-Za-z0-9]", "_", team).upper())
    return {"Authorization": f"Bearer {key}"} if key else {}


def level_groups(config: BenchConfig) -> list[list[tuple[Workload, float]]]:
    """Levels run one after another; with `together: true` in the workload file, level i of
    every workload runs side by side (one team's flood meeting another team's steady load)."""
    workloads = config.workloads
    if not config.together:
        return [[(w, level)] for w in workloads for level in w.levels]
    depth = max(len(w.levels) for w in workloads)
    return [[(w, w.levels[i]) for w in workloads if i < len(w.levels)] for i in range(depth)]


@dataclass(frozen=True)
class _Prepared:
    """A unit's prompts, made before it is sent: its first turn's body, and the new user
    message of each later turn."""

    first: RequestBody
    parts: list[str]


@dataclass
class _Level:
    """A level as it is being sent: its record, its endpoint, its prompts made ahead."""

    record: LevelRecord
    endpoint: Endpoint
    book: PromptBook
    prepared: dict[int, _Prepared] = field(default_factory=dict)  # by unit index

    @property
    def workload(self) -> Workload:
        return self.record.workload


@dataclass(eq=False)
class Scheduler:
    """Sends a run's units over `client` (the lean HTTP/1.1 pool for plain http targets, else
    the aiohttp session) and hands every answer of a measured request to `recorder`."""

    config: BenchConfig
    target: str
    client: aiohttp.ClientSession | Http1Pool
    recorder: Recorder
    _: KW_ONLY
    request_timeout_s: float
    tracer: Tracer | None
    on_level: Callable[[Workload, float, int | None], None]
    # measured requests in flight when the run was cancelled
    cancelled: int = field(default=0, init=False)

    async def warm_up(self, books: dict[str, PromptBook]) -> None:
        """Warm-up requests (compile paths, the prefix cache a steady state would have);
        sent one at a time before the first scrape, and not recorded."""
        for workload in self.config.workloads:
            level = self._level(LevelRecord(workload, 0), books)
            for unit in warmup_units(workload, self.config.scale):
                await self._prepare(level, unit)
                await self._send_unit(level, unit, record=False)

    async def run_levels(self, records: list[LevelRecord], books: dict[str, PromptBook]) -> None:
        """Levels side by side (one, unless the workload file runs them together)."""
        await asyncio.gather(*(self._run_level(self._level(r, books)) for r in records))

    def _level(self, record: LevelRecord, books: dict[str, PromptBook]) -> _Level:
        workload = record.workload
        return _Level(record, ENDPOINTS[workload.endpoint], books[workload.name])

    async def _run_level(self, level: _Level) -> None:
        workload, record = level.workload, level.record
        if workload.open_loop:
            units = open_loop_units(workload, record.level, self.config.scale)
        elif workload.duration_s is None:
            units = [
                unit_plan(workload, record.level, i, self.config.scale)
                for i in range(units_per_level(workload))
            ]
        else:
            units = []  # drawn as the level goes
        for unit in units:
            await self._prepare(level, unit)
        total = sum(len(u.turns) for u in units) if units else None
        self.on_level(workload, record.level, total)
        record.start(time.perf_counter())
        if workload.open_loop:
            await self._open_loop(level, units)
        else:
            await self._closed_loop(level, units)
        record.ended = time.perf_counter()

    async def _closed_loop(self, level: _Level, units: list[Unit]) -> None:
        workload, record = level.workload, level.record
        next_index = iter(range(10**9))
        deadline = None if workload.duration_s is None else record.started + workload.duration_s

        async def worker() -> None:
            for index in next_index:
                if deadline is None:
                    if index >= len(units):
                        return
                    unit = units[index]
                else:
                    if time.perf_counter() >= deadline:
                        return
                    unit = unit_plan(workload, record.level, index, self.config.scale)
                    await self._prepare(level, unit)
                await self._send_unit(level, unit)

        await asyncio.gather(*(worker() for _ in range(int(record.level))))

    async def _open_loop(self, level: _Level, units: list[Unit]) -> None:
        tasks = []
        try:
            for unit in units:
                intended = level.record.started + (unit.offset_s or 0.0)
                delay = intended - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(self._send_unit(level, unit, intended=intended)))
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _prepare(self, level: _Level, unit: Unit) -> None:
        """Make the unit's prompts now (tokenizer calls), outside any measured interval: the
        first turn's body, and the new user message of every later turn."""
        first = await level.book.body(unit.turns[0], self.recorder.model)
        parts = [await level.book.part(plan) for plan in unit.turns[1:]]
        level.prepared[unit.index] = _Prepared(first, parts)

    async def _send_unit(
        self, level: _Level, unit: Unit, *, intended: float | None = None, record: bool = True
    ) -> None:
        prepared = level.prepared.pop(unit.index)
        body = prepared.first
        agent = len(unit.turns) > 1
        output = ""
        for turn, plan in enumerate(unit.turns):
            if turn:
                body = next_turn(body, output, prepared.parts[turn - 1], level.endpoint.chat)
            # a warm-up goes out as an anonymous client's request (a random id, as vLLM makes
            # them up): a sidecar counts it in the server's session, not in this run
            request_id = self.recorder.request_id() if record else uuid.uuid4().hex
            now = time.perf_counter()
            if record and turn == 0:
                level.record.sends.append(now)
            try:
                event = await stream_request(
                    self.client,
                    self.target,
                    level.endpoint,
                    body,
                    request_id,
                    timeout_s=self.request_timeout_s,
                    keep_text=agent,
                    headers=team_headers(level.workload.team),
                    tracer=self.tracer,
                )
            except asyncio.CancelledError:
                self.cancelled += record
                raise
            output = event.pop("output_text", "")
            if record:
                self.recorder.record(
                    level.record, unit, plan, turn, event, body, sent=now, intended=intended
                )
            if event["status"] != "ok":
                return  # an agent session cannot go on without the turn's output


def next_turn(body: RequestBody, output: str, part: str, chat: bool) -> RequestBody:
    """The next agent turn: the conversation so far, the real output, the new message."""
    if chat:
        messages: list[Message] = [
            *body["messages"],
            {"role": "assistant", "content": output},
            {"role": "user", "content": part},
        ]
        return {**body, "messages": messages}
    prompt = body["prompt"]
    if not isinstance(prompt, str):
        raise TypeError("a multi-turn completions workload needs text prompts")
    return {**body, "prompt": f"{prompt}{output}\n{part}"}
