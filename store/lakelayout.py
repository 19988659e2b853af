"""The shared lake's layout, which its writer, its reader and its upkeep share: the Delta
tables (one per store table), their `run_key` partitions, the columns each holds as a SELECT
over the store's table, where each table lives (a folder or an object store URI), and a commit
tried again when it loses a race with another writer's (docs/lake.md; `store.lake` writes it).
"""

from __future__ import annotations

import hashlib
import logging
import random
import re
import secrets
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError

log = logging.getLogger("servescope.lake")

TABLES = ("events", "metric_samples", "runs", "lever_flips", "runtime_events")
PARTITIONED = ("events", "metric_samples", "runtime_events")
RUN_KEY = "run_key"
COMMIT_ATTEMPTS = 12  # a commit that loses a race with another sidecar's is tried again

# Each table's columns (as the store's inserts name theirs): a sidecar of this version writes
# exactly these whatever columns a newer servescope has added to its store.
_COLUMNS: dict[str, str] = {
    "events": "",  # the schema's (store.schema_sql.event_columns)
    "metric_samples": "timezone('UTC', ts) AS ts, target, name, labels, run_id, value",
    "runs": "run_id, timezone('UTC', started_at) AS started_at, timezone('UTC', ended_at) AS"
    " ended_at, label, target, model, vllm_version, CAST(levers AS VARCHAR) AS levers,"
    " CAST(workload AS VARCHAR) AS workload, status, CAST(notes AS VARCHAR) AS notes",
    "lever_flips": "timezone('UTC', ts) AS ts, lever, run_id, before, after, note, before_run_id",
    "runtime_events": "run_id, event_id, type, timezone('UTC', ts) AS ts, request_id, trace_id,"
    " after_request_id, timezone('UTC', ingested_at) AS ingested_at, seq,"
    " CAST(doc AS VARCHAR) AS doc",
}

# `run_key` in SQL: the id when it is a plain name, else its sanitised head and a digest.
RUN_KEY_SQL = (
    "CASE WHEN run_id IS NULL THEN '~' "
    "WHEN regexp_full_match(run_id, '[A-Za-z0-9._-]{1,120}') THEN run_id "
    "ELSE '~' || regexp_replace(left(run_id, 40), '[^A-Za-z0-9._-]', '_', 'g') || '~' "
    "|| left(sha256(run_id), 16) END"
)
_PLAIN = re.compile(r"[A-Za-z0-9._-]{1,120}")


def run_key(run_id: str | None) -> str:
    """The `run_key` partition of a run (as RUN_KEY_SQL computes it)."""
    if run_id is None:
        return "~"
    if _PLAIN.fullmatch(run_id):
        return run_id
    head = re.sub(r"[^A-Za-z0-9._-]", "_", run_id[:40])
    return f"~{head}~{hashlib.sha256(run_id.encode('utf-8', 'surrogatepass')).hexdigest()[:16]}"


def table_columns(table: str) -> str:
    """The columns the lake holds of `table`, as a SELECT list over the store's table."""
    if table == "events":
        from servescope.store import schema_sql  # the writer's (a reader never needs it)

        return ", ".join(
            f'timezone(\'UTC\', "{name}") AS "{name}"' if kind == "TIMESTAMP" else f'"{name}"'
            for name, kind in schema_sql.event_columns()
        )
    return _COLUMNS[table]


def select(table: str, where: str) -> str:
    """A table's rows as the lake holds them (timestamps as UTC instants, `run_key`)."""
    key = f", {RUN_KEY_SQL} AS {RUN_KEY}" if table in PARTITIONED else ""
    return f"SELECT {table_columns(table)}{key} FROM {table} WHERE {where}"  # noqa: S608


def as_delta(rows: pa.Table) -> pa.Table:
    """Timestamps in the one time zone Delta's `timestamp` type names (DuckDB labels UTC
    instants with its session's zone, `Etc/UTC` here)."""
    fields = [
        pa.field(f.name, pa.timestamp("us", "UTC"), f.nullable)
        if pa.types.is_timestamp(f.type) else f
        for f in rows.schema
    ]  # fmt: skip
    return rows.cast(pa.schema(fields))


def is_uri(location: str | Path) -> bool:
    return "://" in str(location)


def table_uri(location: str | Path, table: str) -> str:
    text = str(location)
    if is_uri(text):
        return f"{text.rstrip('/')}/{table}"
    return str(Path(text).resolve() / table)


def storage_options() -> dict[str, str] | None:
    """delta-rs reads the usual variables itself (AWS_ACCESS_KEY_ID, AWS_REGION,
    AWS_ENDPOINT_URL, GOOGLE_SERVICE_ACCOUNT, AZURE_STORAGE_ACCOUNT_NAME …); nothing to add."""
    return None


def new_sidecar_id() -> str:
    """This store's name in the lake: the host (for people) and 48 random bits (uniqueness)."""
    host = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:40] or "host"
    return f"{host}_{secrets.token_hex(6)}"


def sql_literal(value: Any) -> str:
    """A value inside a single-quoted SQL literal (DuckDB's and delta-rs' predicates alike)."""
    return str(value).replace("'", "''")


def retry_commit(action: Callable[[], Any], what: str) -> Any:
    """Run a Delta commit, again after a conflict with another writer's (a merge or a compaction
    that read files another commit changed), with jittered back-off."""
    for attempt in range(COMMIT_ATTEMPTS):
        try:
            return action()
        except CommitFailedError as exc:
            if attempt == COMMIT_ATTEMPTS - 1:
                raise
            log.debug("lake: %s lost a commit race (%s); trying again", what, exc)
            time.sleep(random.uniform(0.02, 0.1) * (attempt + 1))
    return None


class LakeUnavailable(OSError):
    """The lake cannot be opened or created (a bucket without credentials, a folder not
    writable, a table of another format)."""


def brief(exc: BaseException) -> str:
    """An object store's error chain (a dozen indented `↳` lines) as its first and last line."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))  # delta-rs colours its chain
    lines = [line.strip(" ↳") for line in text.splitlines() if line.strip(" ↳")]
    if not lines:
        return repr(exc)
    return lines[0] if len(lines) == 1 else f"{lines[0]} … {lines[-1]}"


def count(con: duckdb.DuckDBPyConnection, sql: str, params: Any = None) -> int:
    """The one number a `SELECT count(*) …` returns (fetched whole: DuckDB 2 refuses more work
    on a connection with a result left open)."""
    rows = con.execute(sql, params).fetchall()
    return int(rows[0][0]) if rows else 0


def exists(location: str | Path) -> bool:
    """Whether a lake is there (its `events` table)."""
    try:
        return DeltaTable.is_deltatable(table_uri(location, "events"), storage_options())
    except OSError:
        return False
