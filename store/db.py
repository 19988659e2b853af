"""The DuckDB event store: short transactions on one file, so readers and writers take turns.

DuckDB lets one process at a time hold a database file open for writing, and a reader in another
process cannot open the file while a writer holds it. The store therefore never keeps a connection
open between operations: every write is one short transaction that closes the file when it
commits, and every read opens the file, queries, and closes it. A process that finds the file
busy retries until `lock_timeout_s`; the wait is at most one writer's transaction.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import duckdb

from servescope.store import queries, reads, runtime, schema_sql, settings
from servescope.store.clock import utcnow
from servescope.store.merge import merge_docs
from servescope.store.validation import (
    EventDoc,
    Record,
    clip,
    dumps,
    load_event,
    run_id_of,
)


def quiet(con: duckdb.DuckDBPyConnection) -> duckdb.DuckDBPyConnection:
    """`con` without DuckDB's own progress bar, which it prints to stdout once a query runs past
    2 s: into the JSON a script reads from `--json`. Commands draw their own (rich, on stderr)."""
    con.execute("SET enable_progress_bar = false")
    return con


@cache
def schema_stamp() -> str:
    """What a store says of its tables once a writer of this version made them match
    store/schema.py (the comment of its `events` table): a digest of that file. A reader finding
    it needs no check of the columns, which would import the ORM (`store.tables`, a third of a
    second of a report's start-up); one finding another (a store this version has not written
    yet) checks them."""
    return hashlib.sha256(Path(__file__).with_name("schema.py").read_bytes()).hexdigest()[:16]


class StoreBusy(RuntimeError):
    """The file stayed locked by another process for longer than the store waits."""


class Store:
    """The servescope store in one DuckDB file."""

    def __init__(self, path: str | Path | None = None, *, lock_timeout_s: float = 30.0) -> None:
        self.path = Path(path) if path is not None else settings.store_path()
        self.lock_timeout_s = lock_timeout_s
        self._initialised = False

    # -- connections -------------------------------------------------------------------------

    def _connect(self, read_only: bool) -> duckdb.DuckDBPyConnection:
        deadline = time.monotonic() + self.lock_timeout_s
        delay = 0.005
        while True:
            try:
                return quiet(duckdb.connect(str(self.path), read_only=read_only))
            except duckdb.IOException as exc:
                if "lock" not in str(exc).lower() or time.monotonic() > deadline:
                    if "lock" in str(exc).lower():
                        raise StoreBusy(f"{self.path} stayed locked: {exc}") from exc
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 0.1)

    def _ensure_schema(self) -> None:
        """The store's tables made to match store/schema.py, and stamped so."""
        if self._initialised:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        create = schema_sql.schema_sql().create
        con = self._connect(read_only=False)
        try:
            con.begin()
            for statement in create:
                con.execute(statement)
            if missing := schema_sql.missing_columns(con):
                from servescope.store import tables  # the ORM, for a store older than the schema

                tables.add_missing_columns(con, missing)
            keyed = con.execute(queries.EVENTS_KEY_INDEX).fetchone()
            if keyed and keyed[0]:  # a store made before `events` lost its key index
                con.execute(queries.UNKEY_EVENTS_RENAME)
                for statement in create:  # creates `events` again, unkeyed
                    con.execute(statement)
                con.execute(queries.UNKEY_EVENTS_COPY)
            if not _stamped(con):
                con.execute(queries.stamp_schema(schema_stamp()))
            con.commit()
        finally:
            con.close()
        self._initialised = True

    @contextmanager
    def write(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """One transaction: committed and the file released on exit, rolled back on error."""
        self._ensure_schema()
        con = self._connect(read_only=False)
        try:
            con.begin()
            yield con
            con.commit()
        except BaseException:
            # a commit that failed (a full disk) has rolled back already
            with suppress(duckdb.TransactionException):
                con.rollback()
            raise
        finally:
            con.close()

    @contextmanager
    def snapshot(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A read transaction of this process while it also writes (a background reader): a
        connection configured as a writer's, since DuckDB opens a file one way per process."""
        self._ensure_schema()
        con = self._connect(read_only=False)
        try:
            con.begin()
            yield con
        finally:
            with suppress(duckdb.TransactionException):
                con.rollback()
            con.close()

    @contextmanager
    def _within(self, con: duckdb.DuckDBPyConnection | None) -> Iterator[duckdb.DuckDBPyConnection]:
        """The caller's transaction `con`, or a transaction of its own when there is none."""
        if con is not None:
            yield con
            return
        with self.write() as tx:
            yield tx

    @contextmanager
    def read(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A read-only view of everything committed so far."""
        if not self.path.exists():
            self._ensure_schema()
        con = self._connect(read_only=True)
        if not self._initialised and not _matches_schema(con):  # a store of an older version
            con.close()
            self._ensure_schema()
            con = self._connect(read_only=True)
        try:
            yield con
        finally:
            con.close()

    # -- writes ------------------------------------------------------------------------------

    def add_events(
        self,
        docs: Iterable[Mapping[str, Any]],
        con: duckdb.DuckDBPyConnection | None = None,
        *,
        cursor: runtime.RuntimeCursor | None = None,
    ) -> int:
        """Insert or merge records that met the rules (`store.validation`'s `EventDoc` and
        `RuntimeDoc`, or a producer's own); returns how many distinct rows they touched.

        Records of the same request (same run and request_id) become one row, merged with
        `merge_docs`, so ingesting the same record twice changes nothing. Agent-runtime lines
        (`store.validation.is_runtime_event`) go to `runtime_events`; pass the same `cursor` for
        every batch of one file so each keeps its place among the requests.
        """
        requests, runtime_rows = runtime.split(docs, cursor or runtime.RuntimeCursor())
        batch: dict[tuple[str, str], EventDoc] = {}
        for doc in requests:
            key = (run_id_of(doc), doc["request_id"])
            batch[key] = merge_docs(batch[key], doc) if key in batch else doc
        if not batch and not runtime_rows:
            return 0
        with self._within(con) as tx:
            return self._add_events(tx, batch) + runtime.insert(tx, runtime_rows)

    def _add_events(
        self, con: duckdb.DuckDBPyConnection, batch: dict[tuple[str, str], EventDoc]
    ) -> int:
        if not batch:
            return 0
        keys = list(batch)
        con.execute(queries.STAGE_EVENTS)
        self._fill_stage(con, keys, [dumps(batch[k]) for k in keys])
        existing = con.execute(queries.EXISTING_FOR_STAGE).fetchall()
        if existing:
            for run_id, request_id, doc in existing:
                key = (run_id, request_id)
                batch[key] = merge_docs(load_event(doc), batch[key])
            con.execute(queries.STAGE_EVENTS)
            self._fill_stage(con, keys, [dumps(batch[k]) for k in keys])
            con.execute(queries.DELETE_STAGED_EVENTS)  # replaced by their merged rows
        con.execute(schema_sql.insert_staged_events())
        con.execute(queries.DROP_STAGE)
        return len(keys)

    @staticmethod
    def _fill_stage(
        con: duckdb.DuckDBPyConnection, keys: Sequence[tuple[str, str]], docs: list[str]
    ) -> None:
        params = {"runs": [k[0] for k in keys], "requests": [k[1] for k in keys], "docs": docs}
        con.execute(queries.FILL_STAGE, params)

    def upsert_run(
        self, run_id: str, con: duckdb.DuckDBPyConnection | None = None, **fields: Any
    ) -> None:
        """Create or update a `runs` row; fields left out (or None) keep their stored value."""
        params: dict[str, object] = {
            name: None
            for name in (
                "started_at",
                "ended_at",
                "label",
                "target",
                "model",
                "vllm_version",
                "levers",
                "workload",
                "status",
                "notes",
            )
        }
        unknown = set(fields) - set(params)
        if unknown:
            raise TypeError(f"unknown run fields: {sorted(unknown)}")
        params.update(fields)
        for name in ("levers", "workload", "notes"):
            if params[name] is not None:
                params[name] = json.dumps(params[name])
        params["run_id"] = run_id
        with self._within(con) as tx:
            tx.execute(queries.UPSERT_RUN, params)

    def add_metric_samples(
        self,
        samples: Iterable[tuple[datetime, str, str, dict[str, str], str | None, float]],
        con: duckdb.DuckDBPyConnection | None = None,
    ) -> None:
        """Samples as (ts, target, name, labels, run_id, value)."""
        rows = [
            (ts, target, name, json.dumps(labels, sort_keys=True), run_id, value)
            for ts, target, name, labels, run_id, value in samples
        ]
        if not rows:
            return
        names = ("ts", "target", "name", "labels", "run_id", "value")
        columns = {n: list(c) for n, c in zip(names, zip(*rows, strict=True), strict=True)}
        with self._within(con) as tx:
            tx.execute(queries.INSERT_METRIC_SAMPLES, columns)

    def add_lever_flip(
        self,
        lever: str,
        before: str | None,
        after: str | None,
        *,
        run_id: str | None = None,
        ts: datetime | None = None,
        note: str | None = None,
        before_run_id: str | None = None,
        con: duckdb.DuckDBPyConnection | None = None,
    ) -> None:
        row = {
            "ts": ts or utcnow(),
            "lever": lever,
            "run_id": run_id,
            "before": before,
            "after": after,
            "note": note,
            "before_run_id": before_run_id,
        }
        with self._within(con) as tx:
            tx.execute(queries.INSERT_LEVER_FLIP, row)

    def replace_flips(
        self,
        run_id: str,
        before_run_id: str,
        rows: Sequence[tuple[str, str | None, str | None]],
        ts: datetime,
        note: str,
        con: duckdb.DuckDBPyConnection,
    ) -> int:
        """The flips from run `before_run_id` to run `run_id` (a server restarted with other
        levers), as (lever, before, after) JSON values; returns how many are new."""
        params = {"run_id": run_id, "before": before_run_id}
        stored = {tuple(r) for r in con.execute(queries.SESSION_FLIPS, params).fetchall()}
        if stored == set(rows):
            return 0
        con.execute(queries.DELETE_SESSION_FLIPS, params)
        for lever, old, new in rows:
            self.add_lever_flip(
                lever, old, new, run_id=run_id, ts=ts, note=note, before_run_id=before_run_id,
                con=con,
            )  # fmt: skip
        return len(set(rows) - stored)

    def runs_of_requests(
        self, request_ids: Sequence[str], con: duckdb.DuckDBPyConnection
    ) -> dict[str, str]:
        """The run each of these requests is stored under (ids vLLM made are unique)."""
        found = con.execute(queries.RUNS_OF_REQUESTS, {"ids": list(request_ids)}).fetchall()
        return dict(found)

    def take_events(
        self, run_id: str, request_ids: Sequence[str], con: duckdb.DuckDBPyConnection
    ) -> list[dict[str, Any]]:
        """Remove these requests of `run_id` and return their records, to store them again."""
        params = {"run_id": run_id, "ids": list(request_ids)}
        return [json.loads(doc) for (doc,) in con.execute(queries.TAKE_EVENTS, params).fetchall()]

    def add_ingest_error(
        self,
        source: str,
        offset: int,
        reason: str,
        raw: str | bytes,
        con: duckdb.DuckDBPyConnection | None = None,
    ) -> None:
        if isinstance(raw, str):
            raw = raw.encode("utf-8", "surrogatepass")
        # bounded (with the original length), and readable whatever the bytes were
        raw = clip(raw).decode("utf-8", errors="backslashreplace")
        now = utcnow()
        row = {"source": source, "offset": offset, "ts": now, "reason": reason, "raw": raw}
        with self._within(con) as tx:
            tx.execute(queries.INSERT_INGEST_ERROR, row)

    # -- reads -------------------------------------------------------------------------------

    def runs(self) -> list[reads.RunListing]:
        """Every run with its event counts (all, ok, errors, rejected) and flips, oldest first."""
        with self.read() as con:
            return reads.runs(con)

    def run_ids(self) -> list[str]:
        with self.read() as con:
            return reads.run_ids(con)

    def has_run(self, run_id: str) -> bool:
        with self.read() as con:
            return reads.has_run(con, run_id) or runtime.has_run(con, run_id)

    def run(self, run_id: str) -> reads.RunRow | None:
        with self.read() as con:
            return reads.run(con, run_id)

    def counter_deltas(self, run_id: str, names: Sequence[str]) -> dict[str, float | None]:
        """How much each counter grew during the run (summed over series; resets handled).

        None for a counter the run's samples cannot measure (`queries.counter_step`): not zero.
        """
        with self.read() as con:
            rows = con.execute(
                queries.COUNTER_DELTAS, {"run_id": run_id, "names": list(names)}
            ).fetchall()
        found = {name: (delta if steps else None) for name, delta, steps in rows}
        return {name: found.get(name) for name in names}

    def gauge_peaks(self, run_id: str, names: Sequence[str]) -> dict[str, float | None]:
        """The highest value each gauge reached during the run (None when never sampled)."""
        with self.read() as con:
            rows = con.execute(queries.GAUGE_PEAKS, {"run_id": run_id, "names": list(names)})
            found = dict(rows.fetchall())
        return {name: found.get(name) for name in names}

    def traced_requests(self, run_id: str) -> tuple[int, int]:
        """(successful requests of the run, those vLLM's trace has reached)."""
        with self.read() as con:
            row = con.execute(queries.TRACED_REQUESTS, {"run_id": run_id}).fetchone()
        return (int(row[0]), int(row[1])) if row else (0, 0)

    def export_lines(self, run_id: str) -> list[Record]:
        """The run's request records and agent-runtime events, in the order of their file."""
        with self.read() as con:
            return runtime.export_lines(con, run_id)

    def runtime_events(self, run_id: str) -> list[runtime.Joined]:
        """The run's agent-runtime events joined to their request (by request_id or trace_id):
        [{"event": doc, "request": doc or None}] in ingestion order."""
        with self.read() as con:
            return runtime.joined(con, run_id)

    def export_events(self, run_id: str) -> list[EventDoc]:
        """The run's records exactly as they were ingested (merged per request)."""
        with self.read() as con:
            rows = con.execute(queries.EXPORT_EVENTS, {"run_id": run_id}).fetchall()
        return [load_event(doc) for (doc,) in rows]


def _stamped(con: duckdb.DuckDBPyConnection) -> bool:
    row = con.execute(queries.SCHEMA_STAMP).fetchone()
    return row is not None and row[0] == schema_stamp()


def _matches_schema(con: duckdb.DuckDBPyConnection) -> bool:
    """The store has every column of store/schema.py: stamped by this version, or checked."""
    if _stamped(con):
        return True
    return not schema_sql.missing_columns(con)
