"""Closed-loop benchmark runs: each workload × concurrency level keeps exactly `concurrency`
requests in flight until the level's requests are done, and every request becomes one event.

Prompts for a level are made before the level starts, so tokenizer round trips never sit inside
a measured interval. Events go to `servescope-data/events/<run_id>.events.jsonl` as they
complete (what a collector tails) and to the store at the end of each level.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import aiohttp

from bench.client import ENDPOINTS, get_json, stream_request
from bench.launcher import process_tree_rss, state_for
from bench.prompts import PromptMaker, payload_for
from bench.workload import BenchConfig, Workload
from store import Store

EVENTS_DIR = Path("servescope-data") / "events"
MEMORY_SAMPLE_S = 0.5


def default_run_id(label: str | None = None) -> str:
    """`run-YYYYMMDD-HHMMSS[-label]` (UTC): sortable, and unique per second."""
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return f"run-{stamp}-{label}" if label else f"run-{stamp}"


@dataclass
class LevelProgress:
    """What a progress display needs to know; the runner calls it, it never calls back."""

    on_level: Callable[[Workload, int], None] = lambda w, c: None
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
        events_dir: Path = EVENTS_DIR,
        request_timeout_s: float = 600.0,
        progress: LevelProgress | None = None,
    ) -> None:
        self.config = config
        self.target = target.rstrip("/")
        self.store = store
        self.run_id = run_id or default_run_id()
        self.model = model
        state = state_for(self.target)
        self.levers = levers if levers is not None else (state.levers if state else None)
        self.server_pid = server_pid or (state.pid if state else None)
        self.server_ready_s = state.ready_s if state else None
        self.events_path = events_dir / f"{self.run_id}.events.jsonl"
        self.request_timeout_s = request_timeout_s
        self.progress = progress or LevelProgress()
        self._seq = 0
        self._peak_rss = 0

    async def run(self) -> RunResult:
        result = RunResult(self.run_id, self.events_path)
        self.events_path.parent.mkdir(parents=True, exist_ok=True)
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        async with aiohttp.ClientSession(connector=connector) as session:
            model = self.model or await self._served_model(session)
            version = await self._vllm_version(session)
            self.store.upsert_run(
                self.run_id,
                started_at=_utc_now(),
                target=self.target,
                model=model,
                vllm_version=version,
                levers=self.levers,
                workload=self.config.to_dict(),
                status="running",
            )
            sampler = asyncio.create_task(self._sample_memory()) if self.server_pid else None
            prompts = PromptMaker(session, self.target, model)
            try:
                with self.events_path.open("a", encoding="utf-8") as sink:
                    for workload in self.config.workloads:
                        for concurrency in workload.concurrency:
                            events = await self._level(
                                session, prompts, model, workload, concurrency, sink
                            )
                            self.store.add_events(events)
                            for event in events:
                                result.events += 1
                                if event["status"] != "ok":
                                    result.errors += 1
                                    cls = event.get("error", event["status"])
                                    result.error_classes[cls] = result.error_classes.get(cls, 0) + 1
            except (asyncio.CancelledError, KeyboardInterrupt):
                result.status = "partial"
                raise
            finally:
                if sampler:
                    sampler.cancel()
                if self._peak_rss:
                    result.memory_peak_gb = round(self._peak_rss / 2**30, 3)
                notes = {
                    "memory_peak_gb": result.memory_peak_gb,
                    "server_ready_s": self.server_ready_s,
                    "events_file": str(self.events_path),
                }
                self.store.upsert_run(
                    self.run_id, ended_at=_utc_now(), status=result.status, notes=notes
                )
        return result

    async def _level(
        self,
        session: aiohttp.ClientSession,
        prompts: PromptMaker,
        model: str,
        workload: Workload,
        concurrency: int,
        sink: TextIO,
    ) -> list[dict[str, Any]]:
        rng = random.Random(f"{workload.seed}:{workload.name}:{concurrency}")
        endpoint = ENDPOINTS[workload.endpoint]
        bodies = [
            payload_for(
                await prompts.exact(workload.input_tokens, rng),
                model,
                workload.output_tokens,
                chat=endpoint.chat,
            )
            for _ in range(workload.requests_per_level)
        ]
        self.progress.on_level(workload, concurrency)
        queue: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
        for body in bodies:
            self._seq += 1
            queue.put_nowait((f"{self.run_id}-{self._seq:06d}", body))
        events: list[dict[str, Any]] = []

        async def worker() -> None:
            while not queue.empty():
                request_id, body = queue.get_nowait()
                event = await stream_request(
                    session,
                    self.target,
                    endpoint,
                    body,
                    request_id,
                    timeout_s=self.request_timeout_s,
                )
                event.update(
                    run_id=self.run_id,
                    source="client",
                    model=model,
                    workload=workload.name,
                    concurrency=concurrency,
                )
                events.append(event)
                sink.write(json.dumps(event) + "\n")
                sink.flush()
                self.progress.on_request(event)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return events

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


def _utc_now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)
