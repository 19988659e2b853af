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
from collections.abc import Sequence
from datetime import datetime
from typing import Any, TypedDict

import duckdb

from servescope.store import queries

JSON_COLUMNS = ("levers", "workload", "notes")  # `runs` columns stored as JSON text


class RunRow(TypedDict):
    """A `runs` row (store.schema.Run) as read: its JSON columns decoded, times naive UTC.
    `levers`, `workload` and `notes` are what the run's producer recorded, free-form."""

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
    notes: dict[str, Any] | None


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


def row(cursor: duckdb.DuckDBPyConnection) -> dict[str, Any] | None:
    """The first row of an executed statement as a dict (None when there is none)."""
    names = [d[0] for d in cursor.description or ()]
    values = cursor.fetchone()
    return None if values is None else dict(zip(names, values, strict=True))


def _decoded(run: dict[str, Any]) -> dict[str, Any]:
    for key in JSON_COLUMNS:
        if isinstance(run.get(key), str):
            run[key] = json.loads(run[key])
    return run


def runs(con: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    """Every run with its event counts (all, ok, errors, rejected) and flips, oldest first;
    a run known only from its events is one too."""
    return [_decoded(run) for run in rows(con.execute(queries.LIST_RUNS))]


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
    if found is None:
        return None
    found = _decoded(found)
    return RunRow(
        run_id=found["run_id"], started_at=found["started_at"], ended_at=found["ended_at"],
        label=found["label"], target=found["target"], model=found["model"],
        vllm_version=found["vllm_version"], levers=found["levers"], workload=found["workload"],
        status=found["status"], notes=found["notes"],
    )  # fmt: skip


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
