"""Benchmark runs: every workload × load level of a workload file against one target.

A level is closed loop (`concurrency`: exactly that many requests — or agent sessions — in
flight) or open loop (`rate`: requests sent on a seeded arrival schedule whatever the server
does, each with its intended and actual send time, so a client that cannot keep up is visible
as schedule lag and reported as saturated). Warm-up requests go before the first scrape.

While the run goes the target's `/metrics` is scraped every second into the store; at the end
the run's notes get the server's run-scoped deltas (prefix-cache hit ratio, preemptions, peak
running/waiting, KV-cache peak) next to the client's own numbers (cached tokens, goodput against
the SLO, achieved vs target rate). Ctrl-C cancels in-flight requests, keeps everything measured
and marks the run `partial`.

`BenchRun` wires three parts with one job each: the scheduler sends (`loadgen/schedule.py`),
the recorder keeps what came back (`loadgen/record.py`), the probe watches the server
(`loadgen/probe.py`).
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from servescope.loadgen.launcher import Levers
from servescope.loadgen.probe import ServerProbe
from servescope.loadgen.prompts import PromptBook, PromptMaker
from servescope.loadgen.record import LevelRecord, Recorder
from servescope.loadgen.request import ClientEvent
from servescope.loadgen.schedule import Scheduler, level_groups
from servescope.loadgen.transport import Http1Pool
from servescope.loadgen.workload import BenchConfig, Workload
from servescope.store import Store, settings
from servescope.store.clock import utcnow
from servescope.store.notes import ClientNotes, LevelNotes, RunNotes, ServerNotes
from servescope.store.paths import inside
from servescope.wire.tracing import tracer_from_env


def default_run_id(label: str | None = None) -> str:
    """`run-YYYYMMDD-HHMMSS[-label]` (UTC): sortable, and unique per second."""
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return f"run-{stamp}-{label}" if label else f"run-{stamp}"


def _no_level(_workload: Workload, _level: float, _total: int | None) -> None:
    """No display: a level starts unseen."""


def _no_request(_event: ClientEvent) -> None:
    """No display: a request is answered unseen."""


@dataclass
class LevelProgress:
    """What a progress display needs to know; the runner calls it, it never calls back.
    `on_level` gets the workload, the level and the requests it will send (None: by duration)."""

    on_level: Callable[[Workload, float, int | None], None] = _no_level
    on_request: Callable[[ClientEvent], None] = _no_request


@dataclass(frozen=True)
class RunOptions:
    """How a run is made and named, beyond the workload and the target (every one optional).

    `levers` and `server_pid` override what the launcher wrote of a server it started;
    `replicas` (name → URL) are the fleet behind a gateway target, each scraped like it;
    `notes` go into the run's notes under the run's own."""

    run_id: str | None = None
    model: str | None = None
    label: str | None = None
    slo: dict[str, float] = field(default_factory=dict)
    levers: Levers | None = None
    server_pid: int | None = None
    replicas: dict[str, str] = field(default_factory=dict)
    notes: RunNotes = field(default_factory=lambda: RunNotes())
    events_dir: Path | None = None
    request_timeout_s: float = 600.0


@dataclass
class RunResult:
    run_id: str
    events_path: Path
    events: int = 0
    errors: int = 0
    memory_peak_gb: float | None = None
    status: str = "complete"
    error_classes: dict[str, int] = field(default_factory=dict)
    levels: list[LevelNotes] = field(default_factory=list)
    server: ServerNotes | None = None
    client: ClientNotes | None = None
    cancelled_in_flight: int = 0
    failure: str | None = None

    @property
    def saturated_levels(self) -> list[LevelNotes]:
        return [lv for lv in self.levels if lv.get("client_saturated")]

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "events_path": str(self.events_path)}


class BenchRun:
    """One run of a workload file against one target."""

    def __init__(
        self,
        config: BenchConfig,
        target: str,
        *,
        store: Store,
        options: RunOptions | None = None,
        progress: LevelProgress | None = None,
    ) -> None:
        options = options or RunOptions()
        self.config = config
        self.options = options
        self.target = target.rstrip("/")
        self.store = store
        self.run_id = options.run_id or default_run_id()
        # a fleet behind the target (a gateway): replica name -> URL, each scraped like a target
        self.replicas = {name: url.rstrip("/") for name, url in options.replicas.items()}
        events_dir = options.events_dir or settings.events_dir()
        self.events_path = inside(events_dir, self.run_id, ".events.jsonl")  # ids are not paths
        self.progress = progress or LevelProgress()
        self.probe = ServerProbe(
            self.target,
            replicas=self.replicas,
            levers=options.levers,
            server_pid=options.server_pid,
        )
        self._lock = asyncio.Lock()  # one store writer at a time: the recorder and the scrapers
        self.recorder = Recorder(
            self.run_id,
            store,
            slo=options.slo,
            lock=self._lock,
            on_request=self.progress.on_request,
        )

    async def run(self) -> RunResult:
        result = RunResult(self.run_id, self.events_path)
        self.events_path.parent.mkdir(parents=True, exist_ok=True)
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        async with aiohttp.ClientSession(connector=connector) as session:
            model, version = await self.probe.identify(session, self.options.model)
            self.recorder.model = model
            self.store.upsert_run(
                self.run_id,
                started_at=utcnow(),
                label=self.options.label,
                target=self.target,
                model=model,
                vllm_version=version,
                levers=self.probe.levers,
                workload=self.config.to_dict(),
                status="running",
            )
            # requests go over the lean HTTP/1.1 pool (http targets); set-up calls over aiohttp
            pool = Http1Pool(self.target) if self.target.startswith("http://") else None
            scheduler = Scheduler(
                self.config,
                self.target,
                pool or session,
                self.recorder,
                request_timeout_s=self.options.request_timeout_s,
                tracer=tracer_from_env("servescope-bench"),  # one trace per request, if asked
                on_level=self.progress.on_level,
            )
            maker = PromptMaker(session, self.target, model)
            books = {w.name: PromptBook(maker, w, self.config.scale) for w in self.config.workloads}
            self.probe.watch(session, self.run_id, self.store, self._lock)
            try:
                await self._levels(scheduler, books, result)
            except (asyncio.CancelledError, KeyboardInterrupt):
                result.status = "partial"
            except (TimeoutError, aiohttp.ClientError) as exc:
                result.status = "failed"
                result.failure = f"the target stopped answering set-up calls: {exc!r}"
            finally:
                gc.unfreeze()
                if pool:
                    pool.close()
                await self.probe.stop()
            self._tally(result, scheduler)
            self.store.upsert_run(
                self.run_id, ended_at=utcnow(), status=result.status, notes=self._notes(result)
            )
        return result

    async def _levels(
        self, scheduler: Scheduler, books: dict[str, PromptBook], result: RunResult
    ) -> None:
        """The warm-up, then every group of levels, each group's events stored as it ends."""
        with self.events_path.open("w", encoding="utf-8") as sink:
            self.recorder.sink = sink
            await scheduler.warm_up(books)
            # the run's first page: its deltas start here (a key page, see the scraper)
            await self.probe.key_page()
            self.probe.start_scraping()
            # What start-up made (modules, the warm-up's prompts) is frozen: a full
            # collection walks it all and would hold a send back mid-level.
            gc.collect()
            gc.freeze()
            for group in level_groups(self.config):
                records = [LevelRecord(w, level) for w, level in group]
                try:
                    await scheduler.run_levels(records, books)
                finally:
                    for record in records:
                        await self.recorder.store_level(record)
                result.levels.extend(self.recorder.level_stats(r) for r in records)
                # a page at each level's end: counters (speculative-decoding drafts…)
                # split exactly between levels that run one after another
                await self.probe.key_page()

    def _tally(self, result: RunResult, scheduler: Scheduler) -> None:
        """The run's totals: requests, failures by class, the client's and the server's
        numbers, what was cancelled, the server's peak memory."""
        result.error_classes = self.recorder.error_classes()
        result.events = len(self.recorder.events)
        result.errors = sum(result.error_classes.values())
        result.client = self.recorder.client_numbers()
        result.server = self.probe.server_numbers()
        result.cancelled_in_flight = scheduler.cancelled
        result.memory_peak_gb = self.probe.memory_peak_gb

    def _notes(self, result: RunResult) -> RunNotes:
        assert result.server is not None and result.client is not None  # `_tally` set them
        return {
            **self.options.notes,
            "memory_peak_gb": result.memory_peak_gb,
            "server_ready_s": self.probe.ready_s,
            "kv_cache": self.probe.kv_cache,
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
