"""Collector checkpoints: how far each file of each source has been read, and what a source
remembers between lines. Saved in the transaction that writes the rows they cover."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import duckdb

from servescope.store import queries
from servescope.store.clock import utcnow

if TYPE_CHECKING:
    from servescope.store.db import Store

STATE_KEY = ""  # file_key of a source's own state row


def load(store: Store, source: str) -> list[dict[str, Any]]:
    """Every checkpoint row of `source` (file rows and its state row)."""
    with store.read() as con:
        return rows_in(con, source)


def rows_in(con: duckdb.DuckDBPyConnection, source: str) -> list[dict[str, Any]]:
    """Every checkpoint row of `source` as `con`'s transaction sees them."""
    rows = con.execute(queries.LIST_CHECKPOINTS, {"source": source}).fetchall()
    out = []
    for src, file_key, path, offset, fp_len, fp, state, updated_at in rows:
        out.append(
            {
                "source": src,
                "file_key": file_key,
                "path": path,
                "offset": int(offset),
                "fp_len": int(fp_len or 0),
                "fp": fp or "",
                "state": json.loads(state) if isinstance(state, str) else state,
                "updated_at": updated_at,
            }
        )
    return out


def save(con: duckdb.DuckDBPyConnection, source: str, rows: Iterable[Mapping[str, Any]]) -> None:
    """Upsert checkpoint rows of `source` inside the caller's transaction."""
    now = utcnow()
    params = [
        {
            "source": source,
            "file_key": row["file_key"],
            "path": row.get("path"),
            "offset": int(row.get("offset", 0)),
            "fp_len": int(row.get("fp_len", 0)),
            "fp": row.get("fp"),
            "state": json.dumps(row.get("state")) if row.get("state") is not None else None,
            "updated_at": now,
        }
        for row in rows
    ]
    if params:
        con.executemany(queries.UPSERT_CHECKPOINT, params)


def state_of(rows: list[dict[str, Any]]) -> dict[str, Any]:
    for row in rows:
        if row["file_key"] == STATE_KEY:
            return dict(row.get("state") or {})
    return {}
