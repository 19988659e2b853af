"""What a test's run left behind, read back: a store's rows, an event's timestamp in seconds."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import duckdb


def rows(store: Path, sql: str) -> list[tuple]:
    """`sql`'s rows from the store file, opened read-only (as a reader beside a writer is)."""
    with duckdb.connect(str(store), read_only=True) as con:
        return con.execute(sql).fetchall()


def epoch(ts: str) -> float:
    """An event's ISO timestamp as epoch seconds."""
    return datetime.fromisoformat(ts).timestamp()
