"""The store's reads on a caller's connection: what other rooms call instead of running the
store's SQL themselves.

A report reads a whole run on one read-only connection (one snapshot, and on a lake one set of
views over its files), and the collector's forwarder reads on the connection its process already
holds; so these take a connection rather than opening one, and return Python values: the
statements stay the store's (`store.queries`), free to change with its tables. `Store`'s own
reads go through the same functions.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, TypedDict, TypeVar

import duckdb

from servescope.store import queries
from servescope.store.notes import RunNotes

T = TypeVar("T")


class RunRow(TypedDict):
    """A `runs` row (store.schema.Run) as read: its JSON columns decoded, times naive UTC.
    `levers` and `workload` are what the run's producer recorded, free-form; `notes` are
    described key by key (`store.notes.RunNotes`)."""

    run_id: str
    started_at: datetime | None
    ended_at: datetime | None
    label: str | None
    target: str | None
    model: str | None
    vllm_version: str | None
    levers: dict[str, Any] | None
    workload: dict[str, Any] | None
    status: str | None
    notes: RunNotes | None


class RunListing(RunRow):
    """A run as `store runs` and `report list` show it: its row (or what its events say:
    model and times), its requests by outcome and its lever flips."""

    events: int
    ok: int
    errors: int
    rejected: int  # refused by admission control
    flips: int


class FlipChange(TypedDict):
    """One lever's change in a flip: its JSON values before and after (None: unset)."""

    lever: str
    before: str | None
    after: str | None


class Flip(TypedDict):
    """The lever flips of one change of runs (`run_id` the run after it, `before_run_id` the
    one before; either None when the flip was written without it), levers in name order."""

    ts: datetime
    run_id: str | None
    before_run_id: str | None
    changes: list[FlipChange]
    note: str | None


def bare_run(run_id: str) -> RunRow:
    """The row of a run known only from its events: nothing but its id."""
    return RunRow(
        run_id=run_id, started_at=None, ended_at=None, label=None, target=None, model=None,
        vllm_version=None, levers=None, workload=None, status=None, notes=None,
    )  # fmt: skip


def rows(cursor: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    """Every row of an executed statement as a dict keyed by its column names."""
    names = [d[0] for d in cursor.description or ()]
    return [dict(zip(names, values, strict=True)) for values in cursor.fetchall()]


def picked(kind: Callable[..., T], source: Mapping[str, object]) -> T:
    """The TypedDict `kind` of `source`'s values under its own keys, in its order (None for
    one `source` lacks): a row, or a wider record, read into a type by the type's own key
    list, so that a key the type gains is read without a second list to keep in step."""
    keys: dict[str, object] = kind.__annotations__  # a TypedDict's keys, its bases' first
    return kind(**{key: source.get(key) for key in keys})


def row(cursor: duckdb.DuckDBPyConnection) -> dict[str, Any] | None:
    """The first row of an executed statement as a dict (None when there is none)."""
    names = [d[0] for d in cursor.description or ()]
    values = cursor.fetchone()
    return None if values is None else dict(zip(names, values, strict=True))


def _decoded(run: dict[str, Any]) -> dict[str, Any]:
    for key in ("levers", "workload"):
        if isinstance(run.get(key), str):
            run[key] = json.loads(run[key])
    if run.get("notes") is not None:
        run["notes"] = notes(run["notes"])
    return run


def notes(raw: str | RunNotes | None) -> RunNotes:
    """A run's `notes` column decoded: the one place its JSON text is read ({} for none, or
    for text that holds no object)."""
    if not raw:
        return {}
    if isinstance(raw, dict):  # decoded already (a row read twice)
        return raw
    try:
        value: RunNotes = json.loads(raw)  # what the producers wrote: an object of RunNotes
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def runs(con: duckdb.DuckDBPyConnection) -> list[RunListing]:
    """Every run with its event counts (all, ok, errors, rejected) and flips, oldest first;
    a run known only from its events is one too."""
    return [picked(RunListing, _decoded(found)) for found in rows(con.execute(queries.LIST_RUNS))]


def run_ids(con: duckdb.DuckDBPyConnection) -> list[str]:
    """Every run's id, oldest first."""
    return [run_id for (run_id, *_) in con.execute(queries.LIST_RUNS).fetchall()]


def has_run(con: duckdb.DuckDBPyConnection, run_id: str) -> bool:
    """Whether the store knows the run, from its `runs` row or from its events."""
    found = con.execute(queries.RUN_EXISTS, {"run_id": run_id}).fetchone()
    return bool(found and found[0])


def run(con: duckdb.DuckDBPyConnection, run_id: str) -> RunRow | None:
    """The run's `runs` row, its JSON columns decoded (None when it has none)."""
    found = row(con.execute(queries.GET_RUN, {"run_id": run_id}))
    return None if found is None else _run_row(found)


def _run_row(found: dict[str, Any]) -> RunRow:
    """A `runs` row read as a dict, as a `RunRow`."""
    return picked(RunRow, _decoded(found))


def serving_sessions(con: duckdb.DuckDBPyConnection, run_id: str) -> list[tuple[str, RunNotes]]:
    """The server sessions that served the run's requests (their runs named by the requests'
    `vllm_session`), with their notes, the earliest started first."""
    found = con.execute(queries.SERVING_SESSIONS, {"run_id": run_id}).fetchall()
    return [(session, notes(raw)) for session, raw in found]


def flips(con: duckdb.DuckDBPyConnection) -> list[Flip]:
    """Every lever flip, grouped by the change of runs it belongs to, oldest first."""
    return [
        Flip(ts=ts, run_id=run_id, before_run_id=before, changes=changes, note=note)
        for ts, run_id, before, changes, note in con.execute(queries.FLIP_LIST).fetchall()
    ]


def is_routed(con: duckdb.DuckDBPyConnection, run_id: str) -> bool:
    """Whether the run's first events carry the gateway's routing decisions (a fleet run):
    a sample of them is read, so any other run pays little."""
    params = {"run_id": run_id, "rows": queries.ROUTED_SAMPLE_ROWS}
    found = con.execute(queries.ROUTED_SAMPLE, params).fetchone()
    return bool(found and found[0])


def events_by_keys(
    con: duckdb.DuckDBPyConnection, keys: Sequence[tuple[str, str]]
) -> list[dict[str, Any]]:
    """The stored (merged) records of some requests, by (run_id, request_id)."""
    params = [[run_id for run_id, _ in keys], [request_id for _, request_id in keys]]
    return [json.loads(doc) for (doc,) in con.execute(queries.EVENTS_BY_KEYS, params).fetchall()]


def run_traffic(con: duckdb.DuckDBPyConnection, run_id: str) -> dict[str, Any]:
    """A run's successful requests: their count, p50/p95 prompt and output tokens
    (`prompt_q`, `output_q`), TTFT and ITL p95, tokens (prompt + output) and the seconds from
    the first start to the last end."""
    found = row(con.execute(queries.RUN_TRAFFIC, {"run_id": run_id}))
    assert found is not None  # an aggregate without GROUP BY always returns its one row
    return found
