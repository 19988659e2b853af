"""Agent-runtime events: the lines of an `.events.jsonl` file that are not request records.

The agent runtime writes tool calls, approvals, test results and replay state into the same
`.events.jsonl` family as the serving layer (`{"type": "tool_call", "run_id": …, "ts": …}`).
They are stored verbatim in `runtime_events`, joinable to requests by `request_id` or `trace_id`,
and exported back where they stood among the request records: each remembers the request record
that preceded it in its run (its anchor), so a file round-trips line for line.

Identity (what makes re-ingestion idempotent) is the run, a digest of the record and its
occurrence number among identical records of the same stream, so two identical tool calls in
one file stay two rows while importing the file twice changes nothing.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypedDict, cast

import duckdb

from servescope.store import queries
from servescope.store.clock import utcnow
from servescope.store.validation import (
    EventDoc,
    InvalidEvent,
    Record,
    RuntimeDoc,
    dumps,
    is_runtime_event,
    load_event,
    load_runtime,
    run_id_of,
)


@dataclass
class RuntimeCursor:
    """Where one stream of lines (a file being imported or tailed) stands between batches."""

    last_request: dict[str, str] = field(default_factory=dict)  # run_id -> last request_id
    seen: Counter[tuple[str, str]] = field(default_factory=Counter)  # (run, digest) -> count


@dataclass(frozen=True)
class RuntimeRow:
    run_id: str
    event_id: str
    after_request_id: str | None
    doc: RuntimeDoc


class Joined(TypedDict):
    """A runtime event and the request it belongs to (None when the run holds none)."""

    event: RuntimeDoc
    request: EventDoc | None


def split(
    docs: Iterable[Mapping[str, Any]], cursor: RuntimeCursor
) -> tuple[list[EventDoc], list[RuntimeRow]]:
    """Request records and runtime rows of a batch in stream order, anchors taken as they come.
    A record that is neither (no `request_id`) raises `InvalidEvent`: the store takes records
    that met the rules, as `store.validation` checks them or a producer of ours writes them."""
    requests: list[EventDoc] = []
    runtime: list[RuntimeRow] = []
    for doc in docs:
        if not is_runtime_event(doc):
            request = _request(doc)
            requests.append(request)
            cursor.last_request[run_id_of(request)] = request["request_id"]
            continue
        run_id = run_id_of(doc)
        digest = hashlib.sha256(
            json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        ).hexdigest()[:32]
        occurrence = cursor.seen[(run_id, digest)]
        cursor.seen[(run_id, digest)] += 1
        runtime.append(
            RuntimeRow(run_id, f"{digest}-{occurrence}", cursor.last_request.get(run_id), doc)
        )
    return requests, runtime


def _request(doc: Mapping[str, Any]) -> EventDoc:
    """A request record as the write path reads it: one with a non-empty string `request_id`
    (a producer's own record is not checked again key by key: `check_request` has its rules)."""
    request_id = doc.get("request_id")
    if not isinstance(request_id, str) or not request_id:
        raise InvalidEvent("missing request_id")
    return cast(EventDoc, doc)  # written by a producer of ours, or checked by `check_request`


def insert(con: duckdb.DuckDBPyConnection, rows: list[RuntimeRow]) -> int:
    """Insert rows not stored yet (same run and event_id: already there, left as is)."""
    if not rows:
        return 0
    now = utcnow()
    con.execute(
        queries.INSERT_RUNTIME_EVENTS,
        {
            "runs": [r.run_id for r in rows],
            "event_ids": [r.event_id for r in rows],
            "docs": [dumps(r.doc) for r in rows],
            "anchors": [r.after_request_id for r in rows],
            "seqs": list(range(len(rows))),
            "ingested_at": now,
        },
    )
    return len(rows)


def table_exists(con: duckdb.DuckDBPyConnection) -> bool:
    """A store file written before runtime events existed has no table until its next write."""
    row = con.execute(queries.RUNTIME_TABLE_EXISTS).fetchone()
    return row is not None and bool(row[0])


def interleave(
    requests: list[tuple[datetime | None, EventDoc]],
    runtime: list[tuple[datetime | None, str | None, RuntimeDoc]],
) -> list[Record]:
    """Request records in export order with each runtime event placed where it stood.

    `requests` are (ts, doc) in export order; `runtime` are (ts, anchor request_id, doc) in
    ingestion order. An event goes right after its anchor; one without a known anchor goes
    before the first request that started after it (at the end when it has no time).
    """
    index = {doc["request_id"]: i for i, (_, doc) in enumerate(requests)}
    after: dict[int, list[RuntimeDoc]] = {}  # slot i: after request i-1 (0 = before all)
    starts = [ts for ts, _ in requests if ts is not None]  # export order sorts ts first
    for ts, anchor, event in runtime:
        if anchor is not None and anchor in index:
            slot = index[anchor] + 1
        elif ts is not None:
            slot = bisect.bisect_right(starts, ts)
        else:
            slot = len(requests)
        after.setdefault(slot, []).append(event)
    out: list[Record] = list(after.get(0, []))
    for i, (_, request) in enumerate(requests, start=1):
        out.append(request)
        out.extend(after.get(i, []))
    return out


def export_lines(con: duckdb.DuckDBPyConnection, run_id: str) -> list[Record]:
    """Every line of the run, request records and runtime events, in file order."""
    requests = [
        (ts, load_event(doc))
        for ts, doc in con.execute(queries.EXPORT_EVENTS_TS, {"run_id": run_id}).fetchall()
    ]
    runtime: list[tuple[datetime | None, str | None, RuntimeDoc]] = []
    if table_exists(con):
        runtime = [
            (ts, anchor, load_runtime(doc))
            for ts, anchor, doc in con.execute(
                queries.EXPORT_RUNTIME_EVENTS, {"run_id": run_id}
            ).fetchall()
        ]
    return interleave(requests, runtime)


def joined(con: duckdb.DuckDBPyConnection, run_id: str) -> list[Joined]:
    """The run's runtime events, each with the request it belongs to (by request_id or
    trace_id) when there is one: {"event": doc, "request": doc or None}."""
    if not table_exists(con):
        return []
    return [
        Joined(event=load_runtime(event), request=load_event(request) if request else None)
        for event, request in con.execute(
            queries.RUNTIME_EVENTS_JOINED, {"run_id": run_id}
        ).fetchall()
    ]


def has_run(con: duckdb.DuckDBPyConnection, run_id: str) -> bool:
    if not table_exists(con):
        return False
    row = con.execute(queries.RUNTIME_RUN_EXISTS, {"run_id": run_id}).fetchone()
    return row is not None and bool(row[0])
