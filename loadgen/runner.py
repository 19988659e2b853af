"""Benchmark runs: every workload × load level of a workload file against one target.

A level is closed loop (`concurrency`: exactly that many requests — or agent sessions — in
flight) or open loop (`rate`: requests sent on a seeded arrival schedule whatever the server
does, each with its intended and actual send time, so a client that cannot keep up is visible
as schedule lag and reported as saturated). Prompts are made before a level starts, so tokenizer
round trips never sit inside a measured interval; warm-up requests go before the first scrape.

While the run goes the target's `/metrics` is scraped every second into the store; at the end
the run's notes get the server's run-scoped deltas (prefix-cache hit ratio, preemptions, peak
running/waiting, KV-cache peak) next to the client's own numbers (cached tokens, goodput against
the SLO, achieved vs target rate). Ctrl-C cancels in-flight requests, keeps everything measured
and marks the run `partial`.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import os
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TextIO

import aiohttp

from servescope.loadgen.client import get_json, stream_request
from servescope.loadgen.launcher import process_tree_rss, state_for
from servescope.loadgen.plan import Unit, open_loop_units, unit_plan, units_per_level, warmup_units
from servescope.loadgen.prompts import PromptBook, PromptMaker, prompt_digest
from servescope.loadgen.server_metrics import MetricsScraper
from servescope.loadgen.transport import Http1Pool
from servescope.loadgen.workload import BenchConfig, Workload
from servescope.store import Store, settings
from servescope.store.paths import inside
from servescope.wire.stream import ENDPOINTS, Endpoint
from servescope.wire.tracing import tracer_from_env

MEMORY_SAMPLE_S = 0.5
# An open-loop level whose sends lag their schedule by more than this (p99), or reach less than
# 90 % of the scheduled rate, was limited by the client, not the server.
SATURATION_LAG_MS = 50.0


def default_run_id(label: str | None = None) -> str:
    """`run-YYYYMMDD-HHMMSS[-label]` (UTC): sortable, and unique per second."""
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return f"run-{stamp}-{label}" if label else f"run-{stamp}"


def meets_slo(event: dict[str, Any], slo: dict[str, float]) -> bool:
    """An ok request within every SLO bound (a bound the request has no value for is met)."""
    if event.get("status") != "ok":
        return False
    return all(event.get(name) is None or event[name] <= bound for name, bound in slo.items())


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (what the store's SQL computes)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class LevelProgress:
    """What a progress display needs to know; the runner calls it, it never calls back.
    `on_level` gets the workload, the level and the requests it will send (None: by duration)."""

    on_level: Callable[[Workload, float, int | None], None] = lambda w, level, total: None
    on_request: Callable[[dict[str, Any]], None] = lambda e: None


@dataclass
class RunResult:
    run_id: str
    events_path: Path
    events: int = 0
    errors: int = 0
    memory_peak_gb: float | None = None
    status: str = "complete"
    error_classes: dict[str, int] = field(default_factory=dict)
    levels: list[dict[str, Any]] = field(default_factory=list)
    server: dict[str, Any] = field(default_factory=dict)
    client: dict[str, Any] = field(default_factory=dict)
    cancelled_in_flight: int = 0
    failure: str | None = None

    @property
    def saturated_levels(self) -> list[dict[str, Any]]:
        return [lv for lv in self.levels if lv.get("client_saturated")]

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "events_path": str(self.events_path)}


class TargetUnreachable(RuntimeError):
    """The target did not answer the set-up calls (models, tokenizer): nothing was measured."""


@dataclass
class _Level:
    """The running state of one level."""

    workload: Workload
    level: float
    endpoint: Endpoint
    book: PromptBook
    events: list[dict[str, Any]] = field(default_factory=list)
    sends: list[float] = field(default_factory=list)
    prepared: dict[int, list[Any]] = field(default_factory=dict)
    started: float = 0.0  # perf_counter at the level's start
    ended: float = 0.0
    wall: datetime = field(default_factory=lambda: datetime.now(UTC))  # wall clock at start


class BenchRun:
    """One run of a workload file against one target."""

    def __init__(
        self,
        config: BenchConfig,
        target: str,
        *,
        store: Store,
        run_id: str | None = None,
        model: str | None = None,
        levers: dict[str, Any] | None = None,
        server_pid: int | None = None,
        events_dir: Path | None = None,
        request_timeout_s: float = 600.0,
        progress: LevelProgress | None = None,
        slo: dict[str, float] | None = None,
        label: str | None = None,
        notes: dict[str, Any] | None = None,
        replicas: dict[str, str] | None = None,
    ) -> None:
        self.config = config
        # a fleet behind the target (a gateway): replica name -> URL, each scraped like a target
        self.replicas = {name: url.rstrip("/") for name, url in (replicas or {}).items()}
        self.target = target.rstrip("/")
        self.store = store
        self.run_id = run_id or default_run_id()
        self.model = model
        state = state_for(self.target)
        self.levers = levers if levers is not None else (state.levers if state else None)
        self.server_pid = server_pid or (state.pid if state else None)
        self.server_ready_s = state.ready_s if state else None
        self.kv_cache = state.kv_cache if state else None
        events_dir = events_dir or settings.events_dir()
        self.events_path = inside(events_dir, self.run_id, ".events.jsonl")  # ids are not paths
        self.request_timeout_s = request_timeout_s
        self.tracer = tracer_from_env("servescope-bench")  # one trace per request, if asked
        self.progress = progress or LevelProgress()
        self.slo = slo or {}
        self.label = label
        self.extra_notes = notes or {}
        self._seq = 0
        self._peak_rss = 0
        self._cancelled = 0
        self._lock = asyncio.Lock()
        self._session: aiohttp.ClientSession | None = None
        # requests go over the lean HTTP/1.1 pool (http targets); set-up calls over aiohttp
        self._pool = Http1Pool(self.target) if self.target.startswith("http://") else None
        self._sink: TextIO | None = None
        self._model = ""

    # -- the run -------------------------------------------------------------------------------

    async def run(self) -> RunResult:
        result = RunResult(self.run_id, self.events_path)
        self.events_path.parent.mkdir(parents=True, exist_ok=True)
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        async with aiohttp.ClientSession(connector=connector) as session:
            self._session = session
            try:
                self._model = self.model or await self._served_model(session)
                version = await self._vllm_version(session)
            except (TimeoutError, aiohttp.ClientError, KeyError, IndexError) as exc:
                raise TargetUnreachable(f"{self.target} did not answer: {exc!r}") from exc
            self.store.upsert_run(
                self.run_id,
                started_at=_utc_now(),
                label=self.label,
                target=self.target,
                model=self._model,
                vllm_version=version,
                levers=self.levers,
                workload=self.config.to_dict(),
                status="running",
            )
            maker = PromptMaker(session, self.target, self._model)
            books = {w.name: PromptBook(maker, w, self.config.scale) for w in self.config.workloads}
            scrapers = [
                MetricsScraper(session, url, self.run_id, self.store, lock=self._lock)
                for url in (self.target, *self.replicas.values())
            ]
            sampler = asyncio.create_task(self._sample_memory()) if self.server_pid else None
            all_events: list[dict[str, Any]] = []
            try:
                with self.events_path.open("w", encoding="utf-8") as sink:
                    self._sink = sink
                    await self._warm_up(books)
                    # the run's first page: its deltas start here (a key page, see the scraper)
                    await asyncio.gather(*(s.scrape(key=True) for s in scrapers))
                    for scraper in scrapers:
                        scraper.start()
                    # What start-up made (modules, the warm-up's prompts) is frozen: a full
                    # collection walks it all and would hold a send back mid-level.
                    gc.collect()
                    gc.freeze()
                    for group in self._level_groups():
                        states = [
                            _Level(w, level, ENDPOINTS[w.endpoint], books[w.name])
                            for w, level in group
                        ]
                        try:
                            await asyncio.gather(*(self._level(s) for s in states))
                        finally:
                            for state in states:
                                all_events.extend(state.events)
                                await self._store_events(state.events)
                        result.levels.extend(self._level_stats(s) for s in states)
                        # a page at each level's end: counters (speculative-decoding drafts…)
                        # split exactly between levels that run one after another
                        await asyncio.gather(*(s.scrape(key=True) for s in scrapers))
            except (asyncio.CancelledError, KeyboardInterrupt):
                result.status = "partial"
            except (TimeoutError, aiohttp.ClientError) as exc:
                result.status = "failed"
                result.failure = f"the target stopped answering set-up calls: {exc!r}"
            finally:
                gc.unfreeze()
                if sampler:
                    sampler.cancel()
                if self._pool:
                    self._pool.close()
                for scraper in scrapers:
                    await scraper.stop()
            self._tally(result, all_events)
            # the run's counters summed over every scraped server: a fleet's totals
            result.server = scrapers[0].server_numbers()
            result.server["scrapes"] = sum(s.scrapes for s in scrapers)
            result.server["scrape_failures"] = sum(s.failures for s in scrapers)
            result.cancelled_in_flight = self._cancelled
            if self._peak_rss:
                result.memory_peak_gb = round(self._peak_rss / 2**30, 3)
            self.store.upsert_run(
                self.run_id, ended_at=_utc_now(), status=result.status, notes=self._notes(result)
            )
        return result

    def _level_groups(self) -> list[list[tuple[Workload, float]]]:
        """Levels run one after another; with `together: true` in the workload file, level i of
        every workload runs side by side (one team's flood meeting another team's steady load)."""
        workloads = self.config.workloads
        if not self.config.together:
            return [[(w, level)] for w in workloads for level in w.levels]
        depth = max(len(w.levels) for w in workloads)
        return [[(w, w.levels[i]) for w in workloads if i < len(w.levels)] for i in range(depth)]

    def _tally(self, result: RunResult, events: list[dict[str, Any]]) -> None:
        for event in events:
            result.events += 1
            if event["status"] != "ok":
                result.errors += 1
                cls = event.get("error", event["status"])
                result.error_classes[cls] = result.error_classes.get(cls, 0) + 1
        ok = [e for e in events if e["status"] == "ok"]
        cached = [e["cached_tokens"] for e in ok if e.get("cached_tokens") is not None]
        prompt = sum(e.get("prompt_tokens") or 0 for e in ok)
        good = [e for e in events if meets_slo(e, self.slo)]
        result.client = {
            "requests": len(events),
            "ok": len(ok),
            "prompt_tokens": prompt,
            "cached_tokens": sum(cached) if cached else None,
            "cached_token_ratio": sum(cached) / prompt if cached and prompt else None,
            "slo": self.slo,
            "good_requests": len(good) if self.slo else None,
            "good_fraction": len(good) / len(events) if self.slo and events else None,
        }

    def _notes(self, result: RunResult) -> dict[str, Any]:
        return {
            **self.extra_notes,
            "memory_peak_gb": result.memory_peak_gb,
            "server_ready_s": self.server_ready_s,
            "kv_cache": self.kv_cache,
            "events_file": str(self.events_path),
            **({"replicas": self.replicas} if self.replicas else {}),
            "scale": self.config.scale,
            "server": result.server,
            "client": result.client,
            "levels": result.levels,
            "errors_by_class": result.error_classes,
            "cancelled_in_flight": result.cancelled_in_flight,
            "failure": result.failure,
        }

    async def _warm_up(self, books: dict[str, PromptBook]) -> None:
        """Warm-up requests (compile paths, the prefix cache a steady state would have);
        sent one at a time before the first scrape, and not stored."""
        for workload in self.config.workloads:
            state = _Level(workload, 0, ENDPOINTS[workload.endpoint], books[workload.name])
            for unit in warmup_units(workload, self.config.scale):
                await self._prepare(state, unit)
                await self._send_unit(state, unit, record=False)

    # -- one level -----------------------------------------------------------------------------

    async def _level(self, state: _Level) -> None:
        workload, level = state.workload, state.level
        if workload.open_loop:
            units = open_loop_units(workload, level, self.config.scale)
        elif workload.duration_s is None:
            units = [
                unit_plan(workload, level, i, self.config.scale)
                for i in range(units_per_level(workload))
            ]
        else:
            units = []  # drawn as the level goes
        for unit in units:
            await self._prepare(state, unit)
        total = sum(len(u.turns) for u in units) if units else None
        self.progress.on_level(workload, level, total)
        state.started = time.perf_counter()
        state.wall = datetime.now(UTC)
        if workload.open_loop:
            await self._open_loop(state, units)
        else:
            await self._closed_loop(state, units)
        state.ended = time.perf_counter()

    async def _closed_loop(self, state: _Level, units: list[Unit]) -> None:
        workload = state.workload
        next_index = iter(range(10**9))
        deadline = None if workload.duration_s is None else state.started + workload.duration_s

        async def worker() -> None:
            for index in next_index:
                if deadline is None:
                    if index >= len(units):
                        return
                    unit = units[index]
                else:
                    if time.perf_counter() >= deadline:
                        return
                    unit = unit_plan(workload, state.level, index, self.config.scale)
                    await self._prepare(state, unit)
                await self._send_unit(state, unit)

        await asyncio.gather(*(worker() for _ in range(int(state.level))))

    async def _open_loop(self, state: _Level, units: list[Unit]) -> None:
        tasks = []
        try:
            for unit in units:
                intended = state.started + (unit.offset_s or 0.0)
                delay = intended - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(self._send_unit(state, unit, intended=intended)))
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _prepare(self, state: _Level, unit: Unit) -> None:
        """Make the unit's prompts now (tokenizer calls), outside any measured interval: the
        first turn's body, and the new user message of every later turn."""
        first = await state.book.body(unit.turns[0], self._model)
        parts = [await state.book.part(plan) for plan in unit.turns[1:]]
        state.prepared[unit.index] = [first, *parts]

    async def _send_unit(
        self, state: _Level, unit: Unit, *, intended: float | None = None, record: bool = True
    ) -> None:
        assert self._session is not None
        prepared = state.prepared.pop(unit.index)
        body: dict[str, Any] = prepared[0]
        agent = len(unit.turns) > 1
        output = ""
        for turn, plan in enumerate(unit.turns):
            if turn:
                body = _next_turn(body, output, prepared[turn], state.endpoint.chat)
            if record:
                self._seq += 1
            # a warm-up goes out as an anonymous client's request (a random id, as vLLM makes
            # them up): a sidecar counts it in the server's session, not in this run
            request_id = f"{self.run_id}-{self._seq:06d}" if record else uuid.uuid4().hex
            now = time.perf_counter()
            if record and turn == 0:
                state.sends.append(now)
            try:
                event = await stream_request(
                    self._pool or self._session,
                    self.target,
                    state.endpoint,
                    body,
                    request_id,
                    timeout_s=self.request_timeout_s,
                    keep_text=agent,
                    headers=team_headers(state.workload.team),
                    tracer=self.tracer,
                )
            except asyncio.CancelledError:
                self._cancelled += record
                raise
            output = event.pop("output_text", "")
            if record:
                self._record(state, unit, plan, turn, event, body, now, intended)
            if event["status"] != "ok":
                return  # an agent session cannot go on without the turn's output

    def _record(
        self,
        state: _Level,
        unit: Unit,
        plan: Any,
        turn: int,
        event: dict[str, Any],
        body: dict[str, Any],
        sent: float,
        intended: float | None,
    ) -> None:
        workload = state.workload
        name = f"{workload.name}:{plan.request_class}" if plan.request_class else workload.name
        event.update(run_id=self.run_id, source="client", model=self._model, workload=name)
        if workload.team:
            event["team"] = workload.team
        if workload.open_loop:
            event["target_rate"] = state.level
        else:
            event["concurrency"] = int(state.level)
        if plan.request_class:
            event["request_class"] = plan.request_class
        event["plan_index"] = plan.index
        event["prompt_sha"] = prompt_digest(body)
        if len(unit.turns) > 1:
            event.update(session=unit.index, turn=turn)
        if intended is not None and turn == 0:
            wall = state.wall + timedelta(seconds=intended - state.started)
            event["intended_ts"] = wall.isoformat(timespec="microseconds").replace("+00:00", "Z")
            event["schedule_lag_ms"] = (sent - intended) * 1000.0
        state.events.append(event)
        assert self._sink is not None
        self._sink.write(json.dumps(event) + "\n")
        self._sink.flush()
        self.progress.on_request(event)

    async def _store_events(self, events: list[dict[str, Any]]) -> None:
        if events:
            async with self._lock:
                await asyncio.to_thread(self.store.add_events, events)

    def _level_stats(self, state: _Level) -> dict[str, Any]:
        """Achieved vs target load, schedule lag, goodput and per-class latency of one level."""
        workload, events = state.workload, state.events
        duration = state.ended - state.started
        ok = [e for e in events if e["status"] == "ok"]
        sends = sorted(state.sends)
        achieved = (len(sends) - 1) / (sends[-1] - sends[0]) if len(sends) > 1 else None
        stats: dict[str, Any] = {
            "workload": workload.name,
            "loop": "open" if workload.open_loop else "closed",
            "concurrency": None if workload.open_loop else int(state.level),
            "target_rate": state.level if workload.open_loop else None,
            "requests": len(events),
            "ok": len(ok),
            "errors": len(events) - len(ok),
            "duration_s": duration,
            "completed_per_s": len(ok) / duration if duration > 0 else None,
            "achieved_rate": achieved,
        }
        if workload.open_loop:
            lags = [e["schedule_lag_ms"] for e in events if "schedule_lag_ms" in e]
            offsets = sorted(u.offset_s or 0.0 for u in open_loop_units(workload, state.level, 1.0))
            scheduled = (
                (len(offsets) - 1) / offsets[-1] if len(offsets) > 1 and offsets[-1] else None
            )
            lag_p99 = percentile(lags, 0.99)
            stats.update(
                scheduled_rate=scheduled,
                schedule_lag_ms={
                    "p50": percentile(lags, 0.5),
                    "p99": lag_p99,
                    "max": max(lags) if lags else None,
                },
                client_saturated=bool(
                    (lag_p99 is not None and lag_p99 > SATURATION_LAG_MS)
                    or (achieved and scheduled and achieved < 0.9 * scheduled)
                ),
            )
        if self.slo:
            good = sum(meets_slo(e, self.slo) for e in events)
            stats["goodput_per_s"] = good / duration if duration > 0 else None
            stats["good_fraction"] = good / len(events) if events else None
        classes: dict[str, dict[str, Any]] = {}
        named = {e["request_class"] for e in events if e.get("request_class") is not None}
        for cls in sorted(named):
            mine = [e for e in ok if e.get("request_class") == cls]
            ttft = [e["ttft_ms"] for e in mine if e.get("ttft_ms") is not None]
            classes[cls] = {
                "requests": len(mine),
                "ttft_ms_p50": percentile(ttft, 0.5),
                "ttft_ms_p95": percentile(ttft, 0.95),
                "e2e_ms_p50": percentile([e["e2e_ms"] for e in mine], 0.5),
            }
        if classes:
            stats["classes"] = classes
        return stats

    # -- target facts --------------------------------------------------------------------------

    async def _served_model(self, session: aiohttp.ClientSession) -> str:
        models = await get_json(session, f"{self.target}/v1/models")
        return str(models["data"][0]["id"])

    async def _vllm_version(self, session: aiohttp.ClientSession) -> str | None:
        try:
            return str((await get_json(session, f"{self.target}/version"))["version"])
        except (aiohttp.ClientError, KeyError, ValueError):
            return None

    async def _sample_memory(self) -> None:
        assert self.server_pid is not None
        while True:
            self._peak_rss = max(self._peak_rss, process_tree_rss(self.server_pid))
            await asyncio.sleep(MEMORY_SAMPLE_S)


def team_headers(team: str | None) -> dict[str, str]:
    """A team's gateway API key, from `$SERVESCOPE_KEY_<TEAM>` (team `flood-a` reads
    `SERVESCOPE_KEY_FLOOD_A`): keys never live in workload files, events or the store."""
    if not team:
        return {}
    key = os.environ.get("SERVESCOPE_KEY_" + re.sub(r"[^A-Za-z0-9]", "_", team).upper())
    return {"Authorization": f"Bearer {key}"} if key else {}


def _next_turn(body: dict[str, Any], output: str, part: str, chat: bool) -> dict[str, Any]:
    """The next agent turn: the conversation so far, the real output, the new message."""
    if chat:
        messages = [
            *body["messages"],
            {"role": "assistant", "content": output},
            {"role": "user", "content": part},
        ]
        return {**body, "messages": messages}
    prompt = body["prompt"]
    if not isinstance(prompt, str):
        raise TypeError("a multi-turn completions workload needs text prompts")
    return {**body, "prompt": f"{prompt}{output}\n{part}"}


def _utc_now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)
