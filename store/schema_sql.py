"""The tables of store/schema.py as DuckDB SQL — each table's DDL and its columns — as
store/tables.py derives them, kept in a cache beside this module per digest of both files.

Deriving them imports the ORM (SQLModel, SQLAlchemy and duckdb_engine: a second of CPU), which
every writer's start paid: each `servescope collect`, `bench run` and `store import`. The cache
is written by the first writer after either file changes (atomically; a folder it cannot write
leaves it deriving every time) and read by the rest; anything unreadable in it is derived
again. The classes stay the one definition: the cache holds only what they give.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import duckdb

from servescope.store import queries

Columns = list[tuple[str, str]]
HERE = Path(__file__).resolve().parent
SOURCES = (HERE / "schema.py", HERE / "tables.py")


@dataclass(frozen=True)
class SchemaSql:
    create: list[str]  # CREATE TABLE IF NOT EXISTS, one per table, in TABLES' order
    columns: dict[str, Columns]  # per table, (name, DuckDB type) in the class's order


def cache_path() -> Path:
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in SOURCES)).hexdigest()
    return HERE / "__pycache__" / f"schema_sql.{digest[:16]}.json"


def derive() -> SchemaSql:
    """From the classes, through the ORM."""
    from servescope.store import tables
    from servescope.store.schema import TABLES

    return SchemaSql(
        tables.create_statements(), {tables.table_of(m).name: tables.columns(m) for m in TABLES}
    )


def _read(path: Path) -> SchemaSql | None:
    try:
        raw = json.loads(path.read_text())
        create, columns = raw["create"], raw["columns"]
        sql = SchemaSql(
            [str(s) for s in create],
            {str(t): [(str(n), str(k)) for n, k in cols] for t, cols in columns.items()},
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return sql if sql.create and "events" in sql.columns else None


def _write(path: Path, sql: SchemaSql) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        path.parent.mkdir(exist_ok=True)
        tmp.write_text(json.dumps({"create": sql.create, "columns": sql.columns}))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


@cache
def schema_sql() -> SchemaSql:
    path = cache_path()
    cached = _read(path)
    if cached is not None:
        return cached
    derived = derive()
    _write(path, derived)
    return derived


def event_columns() -> Columns:
    return schema_sql().columns["events"]


@cache
def insert_staged_events() -> str:
    return queries.insert_staged_events(event_columns())


def missing_columns(con: duckdb.DuckDBPyConnection) -> list[tuple[str, str]]:
    """The schema's (table, column) pairs the store lacks."""
    pairs = [(table, name) for table, cols in schema_sql().columns.items() for name, _ in cols]
    params = {"tables": [p[0] for p in pairs], "columns": [p[1] for p in pairs]}
    return [tuple(row) for row in con.execute(queries.MISSING_COLUMNS, params).fetchall()]
