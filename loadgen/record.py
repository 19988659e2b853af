"""What a benchmark run keeps of its requests: each answered request as an event (stamped with
the run, the workload, the load level and, in an open loop, its schedule lag), written to the
run's `.events.jsonl` as it comes and to the store at each level's end; and the numbers the run's
notes carry, per level (achieved vs target load, schedule lag, goodput, per-class latency) and
for the whole run (cached tokens, goodput against the SLO).

The recorder never sends anything: the scheduler (`loadgen/schedule.py`) hands it each answer.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TextIO

from servescope.loadgen.plan import RequestPlan, Unit, open_loop_units
from servescope.loadgen.prompts import prompt_digest
from servescope.loadgen.request import ClientEvent, RequestBody
from servescope.loadgen.workload import Workload
from servescope.store import Store
from servescope.store.notes import ClassLatency, ClientNotes, LevelNotes

# An open-loop level whose sends lag their schedule by more than this (p99), or reach less than
# 90 % of the scheduled rate, was limited by the client, not the server.
SATURATION_LAG_MS = 50.0


def meets_slo(event: ClientEvent, slo: dict[str, float]) -> bool:
    """An ok request within every SLO bound (a bound the request has no value for is met)."""
    if event.get("status") != "ok":
        return False
    return all(_within(event.get(name), bound) for name, bound in slo.items())


def _within(value: object, bound: float) -> bool:
    return not isinstance(value, int | float) or value <= bound


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (what the store's SQL computes)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class LevelRecord:
    """What one level sent and got back, and when it ran."""

    workload: Workload
    level: float
    events: list[ClientEvent] = field(default_factory=list)
    sends: list[float] = field(default_factory=list)  # perf_counter of each first turn's send
    started: float = 0.0  # perf_counter at the level's start
    ended: float = 0.0
    wall: datetime = field(default_factory=lambda: datetime.now(UTC))  # wall clock at start

    def start(self, now: float) -> None:
        self.started, self.wall = now, datetime.now(UTC)


class Recorder:
    """The run's events: numbered, stamped, written to `sink` at once and to the store per
    level; `on_request` (a progress display) sees each one."""

    def __init__(
        self,
        run_id: str,
        store: Store,
        *,
        slo: dict[str, float],
        lock: asyncio.Lock,
        on_request: Callable[[ClientEvent], None],
    ) -> None:
        self.run_id = run_id
        self.store = store
        self.slo = slo
        self.model = ""  # the served model, once the server said it
        self.sink: TextIO | None = None
        self.events: list[ClientEvent] = []  # every level's, in level order
        self._lock = lock  # one store writer at a time in this process (the scrapers too)
        self._on_request = on_request
        self._seq = 0

    def request_id(self) -> str:
        """The next recorded request's `X-Request-Id`: `<run>-000001`, …"""
        self._seq += 1
        return f"{self.run_id}-{self._seq:06d}"

    def record(
        self,
        level: LevelRecord,
        unit: Unit,
        plan: RequestPlan,
        turn: int,
        event: ClientEvent,
        body: RequestBody,
        *,
        sent: float,
        intended: float | None,
    ) -> None:
        """Stamp an answered request with what it was part of and keep it."""
        workload = level.workload
        name = f"{workload.name}:{plan.request_class}" if plan.request_class else workload.name
        event["run_id"], event["source"] = self.run_id, "client"
        event["model"], event["workload"] = self.model, name
        if workload.team:
            event["team"] = workload.team
        if workload.open_loop:
            event["target_rate"] = level.level
        else:
            event["concurrency"] = int(level.level)
        if plan.request_class:
            event["request_class"] = plan.request_class
        event["plan_index"] = plan.index
        event["prompt_sha"] = prompt_digest(body)
        if len(unit.turns) > 1:
            event["session"], event["turn"] = unit.index, turn
        if intended is not None and turn == 0:
            wall = level.wall + timedelta(seconds=intended - level.started)
            event["intended_ts"] = wall.isoformat(timespec="microseconds").replace("+00:00", "Z")
            event["schedule_lag_ms"] = (sent - intended) * 1000.0
        level.events.append(event)
        assert self.sink is not None
        self.sink.write(json.dumps(event) + "\n")
        self.sink.flush()
        self._on_request(event)

    async def store_level(self, level: LevelRecord) -> None:
        """The level's events into the store (and the run's list)."""
        self.events.extend(level.events)
        if level.events:
            async with self._lock:
                await asyncio.to_thread(self.store.add_events, level.events)

    def level_stats(self, level: LevelRecord) -> LevelNotes:
        """Achieved vs target load, schedule lag, goodput and per-class latency of one level."""
        workload, events = level.workload, level.events
        duration = level.ended - level.started
        ok = [e for e in events if e["status"] == "ok"]
        sends = sorted(level.sends)
        achieved = (len(sends) - 1) / (sends[-1] - sends[0]) if len(sends) > 1 else None
        stats: LevelNotes = {
            "workload": workload.name,
            "loop": "open" if workload.open_loop else "closed",
            "concurrency": None if workload.open_loop else int(level.level),
            "target_rate": level.level if workload.open_loop else None,
            "requests": len(events),
            "ok": len(ok),
            "errors": len(events) - len(ok),
            "duration_s": duration,
            "completed_per_s": len(ok) / duration if duration > 0 else None,
            "achieved_rate": achieved,
        }
        if workload.open_loop:
            _open_loop_stats(stats, level, achieved)
        if self.slo:
            good = sum(meets_slo(e, self.slo) for e in events)
            stats["goodput_per_s"] = good / duration if duration > 0 else None
            stats["good_fraction"] = good / len(events) if events else None
        if classes := _class_latency(events):
            stats["classes"] = classes
        return stats

    def client_numbers(self) -> ClientNotes:
        """The whole run's requests as the client saw them."""
        events = self.events
        ok = [e for e in events if e["status"] == "ok"]
        cached = [c for e in ok if (c := e.get("cached_tokens")) is not None]
        prompt = sum(e.get("prompt_tokens") or 0 for e in ok)
        good = [e for e in events if meets_slo(e, self.slo)]
        return {
            "requests": len(events),
            "ok": len(ok),
            "prompt_tokens": prompt,
            "cached_tokens": sum(cached) if cached else None,
            "cached_token_ratio": sum(cached) / prompt if cached and prompt else None,
            "slo": self.slo,
            "good_requests": len(good) if self.slo else None,
            "good_fraction": len(good) / len(events) if self.slo and events else None,
        }

    def error_classes(self) -> dict[str, int]:
        """Failed requests by error class (their status where they name none)."""
        classes: dict[str, int] = {}
        for event in self.events:
            if event["status"] != "ok":
                cls = str(event.get("error", event["status"]))
                classes[cls] = classes.get(cls, 0) + 1
        return classes


def _open_loop_stats(stats: LevelNotes, level: LevelRecord, achieved: float | None) -> None:
    """An open loop's scheduled rate and schedule lag, and whether the client kept up."""
    lags = [e["schedule_lag_ms"] for e in level.events if "schedule_lag_ms" in e]
    offsets = sorted(u.offset_s or 0.0 for u in open_loop_units(level.workload, level.level, 1.0))
    scheduled = (len(offsets) - 1) / offsets[-1] if len(offsets) > 1 and offsets[-1] else None
    lag_p99 = percentile(lags, 0.99)
    stats["scheduled_rate"] = scheduled
    stats["schedule_lag_ms"] = {
        "p50": percentile(lags, 0.5),
        "p99": lag_p99,
        "max": max(lags) if lags else None,
    }
    stats["client_saturated"] = bool(
        (lag_p99 is not None and lag_p99 > SATURATION_LAG_MS)
        or (achieved and scheduled and achieved < 0.9 * scheduled)
    )


def _class_latency(events: list[ClientEvent]) -> dict[str, ClassLatency]:
    """Latency of the ok requests per request class, for every class the level's requests
    name (a class whose requests all failed: a row of none)."""
    classes: dict[str, ClassLatency] = {}
    ok = [e for e in events if e["status"] == "ok"]
    named = {e["request_class"] for e in events if e.get("request_class") is not None}
    for cls in sorted(named):
        mine = [e for e in ok if e.get("request_class") == cls]
        ttft = [t for e in mine if (t := e.get("ttft_ms")) is not None]
        classes[cls] = {
            "requests": len(mine),
            "ttft_ms_p50": percentile(ttft, 0.5),
            "ttft_ms_p95": percentile(ttft, 0.95),
            "e2e_ms_p50": percentile([t for e in mine if (t := e.get("e2e_ms")) is not None], 0.5),
        }
    return classes
