"""Reading a lake in place: a `Store` whose read connection's tables are views over the lake's
Delta tables, so every query of the store and the reports runs unchanged (`--lake DIR|URI`).

delta-rs resolves each table's current version (which files, which partition values) and hands
DuckDB an Arrow dataset of them; DuckDB scans it, pushing filters and projections down, so
`run_key` partitions and Parquet row groups are skipped. No rule of servescope's applies: the
Delta log already says which rows are current.

A lake `scoped` to some runs reads only their `run_key` partitions (a server session's run,
whose requests lie in its client runs' partitions too, reads every partition, filtered on
`vllm_session`), so a report's cost follows its runs' events, not the lake's size; its runs'
rows are then read once into memory (`_copy_events`).
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from servescope.store.db import Store, quiet
from servescope.store.lakelayout import (
    PARTITIONED,
    RUN_KEY,
    TABLES,
    count,
    exists,
    is_uri,
    run_key,
    sql_literal,
    storage_options,
    table_uri,
)
from servescope.store.queries import ROUTED_SAMPLE, ROUTED_SAMPLE_ROWS

SESSION_PREFIX = "vllm-"  # a server session's run (collector/sessions.py)
COPY_ROWS = 2_000_000  # the most events a scoped read copies into memory (see `_copy_events`)


class NoLake(ValueError):
    """A `--lake` folder (or glob, or URI) that holds no lake."""


class ReadOnlyLake(RuntimeError):
    """Something tried to write through a lake reader: sidecars write lakes (`collect --lake`)."""


def lake_roots(specs: Sequence[str | Path]) -> list[str]:
    """The lakes `--lake` names: folders, globs of folders, or object store URIs, each holding
    the `events` Delta table a sidecar creates when it starts."""
    roots: list[str] = []
    for spec in specs:
        text = str(spec)
        if is_uri(text):
            matches = [text]
        else:
            found = sorted(glob.glob(text)) if glob.has_magic(text) else [text]
            matches = [str(Path(m).resolve()) for m in found]
        lakes = [m for m in matches if exists(m)]
        if not lakes:
            raise NoLake(
                f"no lake at {text}: a lake is what `servescope collect --lake` writes (a Delta "
                "table per store table: events/_delta_log/ …)"
            )
        roots.extend(r for r in lakes if r not in roots)
    return roots


class Lake(Store):
    """Read-only store over one or more lakes (see the module docstring)."""

    def __init__(self, roots: Sequence[str | Path], runs: Sequence[str] | None = None) -> None:
        self.roots = lake_roots(roots)
        self.scope = tuple(dict.fromkeys(runs)) if runs is not None else None
        self.path = Path(", ".join(self.roots))  # for messages and titles
        self.lock_timeout_s = 0.0
        self._initialised = True

    def scoped(self, runs: Sequence[str]) -> Lake:
        """The same lake, read only as far as these runs need."""
        return Lake(self.roots, runs)

    @contextmanager
    def write(self) -> Iterator[duckdb.DuckDBPyConnection]:
        raise ReadOnlyLake("a lake is read-only here: sidecars write it (collect --lake)")
        yield  # pragma: no cover - a generator for contextmanager

    def has_run(self, run_id: str) -> bool:
        """A run with requests or runtime events in the lake (a file in its partition: Delta
        adds no file without rows), or a `runs` row; nothing else is read."""
        key = [(RUN_KEY, "=", run_key(run_id))]
        for root in self.roots:
            for table in ("events", "runtime_events"):
                if _table(root, table).file_uris(file_pruning_predicate=key):
                    return True
        con = quiet(duckdb.connect())
        try:
            for k, root in enumerate(self.roots):
                rows = _source(con, root, "runs", None, k)
                sql = f"SELECT count(*) FROM ({rows}) WHERE run_id = $1"  # noqa: S608
                if count(con, sql, [run_id]):
                    return True
        finally:
            con.close()
        return False

    @contextmanager
    def read(self) -> Iterator[duckdb.DuckDBPyConnection]:
        con = quiet(duckdb.connect())
        # a report's reads are order-free (quantiles, `favg` means, sorted samples): copying a
        # scope's rows in whatever order the threads read them takes a third less CPU
        con.execute("SET preserve_insertion_order = false")
        try:
            self._views(con)
            yield con
        finally:
            con.close()

    # -- views -------------------------------------------------------------------------------

    def _views(self, con: duckdb.DuckDBPyConnection) -> None:
        sessions = [r for r in self.scope or () if r.startswith(SESSION_PREFIX)]
        keys = None if self.scope is None or sessions else [run_key(r) for r in self.scope]
        for table in TABLES:
            scoped = keys if table in PARTITIONED else None
            sources = [_source(con, root, table, scoped, k) for k, root in enumerate(self.roots)]
            con.execute(f"CREATE VIEW {table} AS " + " UNION ALL BY NAME ".join(sources))
        if self.scope is not None and count(con, "SELECT count(*) FROM events") <= COPY_ROWS:
            self._copy_events(con, keys, sessions)

    def _copy_events(
        self, con: duckdb.DuckDBPyConnection, keys: list[str] | None, sessions: list[str]
    ) -> None:
        """A report queries its runs' events some fifty times, and each query of a view scans
        the dataset again: the runs' rows are read once into one in-memory table instead, when
        they fit (COPY_ROWS keeps a report under 1 GiB; larger runs are read through the views,
        slower, in bounded memory).

        Only what a report can read is held: not a column NULL in every file of the scope (a
        client run's server figures, its trace ids: the Delta log's statistics say so, nothing
        is read), nor `doc`, the verbatim record, unless a server session's checks or a fleet
        run's replicas read it (reports.sql: _CHAT, ROUTED_SAMPLE, BY_REPLICA). `events` is then
        a view over the table giving those columns as NULLs. One run at a time, so each run's
        rows lie together and a query of one run skips the other's row groups."""
        columns = [(name, kind) for name, kind, *_ in con.execute("DESCRIBE events").fetchall()]
        empty = set.intersection(
            *(_empty_columns(root, keys) for root in self.roots)
        ) if self.roots else set()  # fmt: skip
        if not sessions and not any(_fleet(con, run) for run in self.scope or ()):
            empty.add("doc")
        empty &= {name for name, _kind in columns}
        held = ", ".join(f'"{name}"' for name, _kind in columns if name not in empty)
        con.execute("ALTER VIEW events RENAME TO events_in_lake")
        con.execute(f"CREATE TABLE events_held AS SELECT {held} FROM events_in_lake LIMIT 0")  # noqa: S608
        add = f"INSERT INTO events_held SELECT {held} FROM events_in_lake"  # noqa: S608
        for run in self.scope or ():
            con.execute(add + " WHERE run_id = $1", [run])
        if sessions:
            con.execute(
                add + " WHERE list_contains($1, vllm_session) AND NOT list_contains($2, run_id)",
                [sessions, list(self.scope or ())],
            )
        view = ", ".join(
            f'CAST(NULL AS {kind}) AS "{name}"' if name in empty else f'"{name}"'
            for name, kind in columns
        )
        con.execute(f"CREATE VIEW events AS SELECT {view} FROM events_held")  # noqa: S608


def _table(root: str, table: str) -> DeltaTable:
    return DeltaTable(table_uri(root, table), storage_options=storage_options())


def _source(
    con: duckdb.DuckDBPyConnection, root: str, table: str, keys: list[str] | None, k: int
) -> str:
    """One lake's table as the store holds it (timestamps as UTC wall time, no `run_key`), only
    these `run_key` partitions. delta-rs lists the current version's files; DuckDB reads them
    in place (a local lake) or, from object storage, through delta-rs' Arrow dataset into a
    table of this connection (DuckDB's own S3 reader is an extension this DuckDB lacks)."""
    delta = _table(root, table)
    pruning = [(RUN_KEY, "in", keys)] if keys is not None else None
    files = [] if keys == [] else delta.file_uris(file_pruning_predicate=pruning)
    name = f"lake_{table}_{k}"
    if files and not is_uri(root):
        listed = "[" + ", ".join(f"'{sql_literal(f)}'" for f in files) + "]"
        con.execute(
            f"CREATE VIEW {name} AS SELECT * FROM read_parquet({listed}, union_by_name = true)"  # noqa: S608
        )
    else:
        if files:
            rows = delta.to_pyarrow_dataset(file_pruning_predicate=pruning).to_table()
        else:
            rows = delta.to_pyarrow_dataset().schema.empty_table()
        con.register(f"{name}_arrow", rows)
        con.execute(f"CREATE TABLE {name} AS SELECT * FROM {name}_arrow")  # noqa: S608
        con.unregister(f"{name}_arrow")
    columns = con.execute(f"DESCRIBE SELECT * FROM {name}").fetchall()  # noqa: S608
    out = [
        f"timezone('UTC', \"{col}\") AS \"{col}\"" if kind == "TIMESTAMP WITH TIME ZONE"
        else f'"{col}"'
        for col, kind, *_ in columns
        if col != RUN_KEY
    ]  # fmt: skip
    return f"SELECT {', '.join(out)} FROM {name}"  # noqa: S608


def _empty_columns(root: str, keys: list[str] | None) -> set[str]:
    """The columns no file of these partitions holds a value of, by the Delta log's statistics
    (a file without them: none is empty)."""
    actions = pa.table(_table(root, "events").get_add_actions(flatten=True))
    if keys is not None:
        mask = pc.is_in(actions.column(f"partition.{RUN_KEY}"), pa.array(keys, pa.string()))
        actions = actions.filter(mask)
    if actions.num_rows == 0:
        return set()
    records = pc.sum(actions.column("num_records")).as_py() or 0
    empty = set()
    for name in actions.column_names:
        if name.startswith("null_count."):
            counts = actions.column(name)
            if counts.null_count == 0 and pc.sum(counts).as_py() == records:
                empty.add(name.removeprefix("null_count."))
    empty.discard("run_id")
    return empty


def _fleet(con: duckdb.DuckDBPyConnection, run_id: str) -> bool:
    """A fleet run, as reports.replicas tells one: its notes name replicas, or its first
    events carry routing decisions (read from the lake)."""
    rows = con.execute("SELECT notes FROM runs WHERE run_id = $1", [run_id]).fetchall()
    try:
        notes = json.loads(rows[0][0]) if rows and rows[0][0] else {}
    except (TypeError, ValueError):
        notes = {}
    if isinstance(notes, dict) and notes.get("replicas"):
        return True
    params = {"run_id": run_id, "rows": ROUTED_SAMPLE_ROWS}
    return bool(count(con, ROUTED_SAMPLE, params))  # `events` still the lake's view
