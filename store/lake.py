"""The shared lake: one Delta Lake table per store table, which many sidecars on many hosts
append to and every engine reads with its own Delta reader (docs/lake.md).

    LAKE/events/           requests, partitioned by `run_key`
    LAKE/runtime_events/   agent-runtime events, partitioned by `run_key`
    LAKE/metric_samples/   scraped samples, partitioned by `run_key`
    LAKE/runs/             one row per run
    LAKE/lever_flips/      a restart's flips

Each is a Delta table (`_delta_log/` and Parquet files), written through delta-rs, so the format
does what a shared folder needs: commits are atomic and ordered among any number of writers,
a request completed by a later flush (its log line, then its trace) is updated in place by a
MERGE, a request that moved to another run is deleted from the old one, and readers see each
committed version of each request once, with no rule of ours. `LAKE` is a folder or an object
store URI (`s3://bucket/prefix`): delta-rs writes both.

`run_key` is the run id when it is a plain name (letters, digits, `.`, `_`, `-`; 1–120 bytes),
else `~<its head, sanitised>~<digest>`: a partition folder every file system and bucket takes.
Readers filter on `run_id` as they would anyway; `run_key` only prunes.

Exactly once with the store. A flush commits to the store first, and in the same transaction
saves what it owes the lake (`Owed`: its requests' rows, taken in the transaction; the rowids
past which its samples and runtime events lie; the requests it updated or moved; the runs and
flips it changed), together with what earlier flushes still owe (a trickle's flushes reach the
lake together, every `INTERVAL_S`). A thread then writes them, one Delta commit per table, each
carrying Delta's transaction identifier (`txn`: this sidecar's application id and the last
flush's number). The next flush waits for a thread in flight before it touches the store, and
writes the rows itself if the thread failed. A start after a crash reads, per table, the last
flush the lake committed for this sidecar (`DeltaTable.transaction_version`) and writes what is
missing: a flush is never lost and never written twice, whether the sidecar died before, inside
or after a Delta commit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import duckdb
import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError

from servescope.store import checkpoints
from servescope.store.db import StoreBusy
from servescope.store.lakelayout import (
    PARTITIONED,
    RUN_KEY,
    TABLES,
    LakeUnavailable,
    as_delta,
    brief,
    count,
    is_uri,
    new_sidecar_id,
    retry_commit,
    run_key,
    select,
    sql_literal,
    storage_options,
    table_uri,
)
from servescope.store.lakeowed import Mark, Owed, OwedState, changed_flips

if TYPE_CHECKING:
    from servescope.store.db import Store

log = logging.getLogger("servescope.lake")

# A trickle commits to the store every 0.25 s; the lake gets its flushes together at most this
# often (a Delta commit per table each time: its log, listed at each commit, stays short).
INTERVAL_S = 5.0
HELD_ROWS = 250_000  # or sooner, once the flushes not yet written hold this many requests
FRESH_ROWS = 10_000  # a flush of this many new requests and nothing else is read after its commit


class LakeState(TypedDict, total=False):
    """What a writer keeps in the store (its checkpoint's state): its name in the lake, the
    last flush it committed, and what the lake is owed."""

    sidecar: str
    seq: int
    owed: OwedState


@dataclass
class _Pending:
    owed: Owed
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class LakeWriter:
    """Writes each committed flush of one store to the lake (see the module docstring).

    In the flush's store transaction: `mark(con)` first (it settles a write in flight), then
    `owe(con, mark, …)` just before the commit; after the commit `committed(owed)`.
    """

    def __init__(
        self, location: str | Path, store: Store, *, interval_s: float = INTERVAL_S
    ) -> None:
        self.interval_s = interval_s
        self.location = str(location) if is_uri(location) else str(Path(location).resolve())
        self.store = store
        self.source = f"lake:{self.location}"
        state = self._state_of(None)
        self.sidecar: str = state.get("sidecar") or self._name_sidecar()
        self.app_id = f"servescope-{self.sidecar}"
        self.seq: int = int(state.get("seq") or 0)
        self._tables: dict[str, DeltaTable] = {}
        self._pending: _Pending | None = None  # a write on its thread
        self._owed: Owed | None = None  # committed flushes not yet written, as one
        self._failed = False  # a write of `_owed` failed: it is written as it is before more
        self._last_write: float | None = None  # none yet: the first flush is due at once
        self.touched: set[str] = set()  # run keys written since the last compaction
        try:
            if not is_uri(self.location):
                Path(self.location).mkdir(parents=True, exist_ok=True)
            self._create_tables()
            with self.store.snapshot() as con:  # a crash may have left flushes unwritten
                self._adopt(con)
                self._drain(con)
        except (DeltaError, OSError) as exc:
            raise LakeUnavailable(brief(exc)) from exc

    def _state_of(self, con: duckdb.DuckDBPyConnection | None) -> LakeState:
        """This writer's state as the store holds it (`con`'s transaction, or a read)."""
        rows = (
            checkpoints.load(self.store, self.source)
            if con is None
            else checkpoints.rows_in(con, self.source)
        )
        raw = checkpoints.state_of(rows)
        state = LakeState(seq=int(raw.get("seq") or 0))
        if raw.get("sidecar"):
            state["sidecar"] = str(raw["sidecar"])
        if raw.get("owed"):
            state["owed"] = raw["owed"]  # as `_save` wrote it: an OwedState
        return state

    def _name_sidecar(self) -> str:
        sidecar = new_sidecar_id()
        with self.store.write() as con:
            self._save(con, LakeState(sidecar=sidecar, seq=0))
        return sidecar

    def _save(self, con: duckdb.DuckDBPyConnection, state: LakeState) -> None:
        checkpoints.save(con, self.source, [{"file_key": checkpoints.STATE_KEY, "state": state}])

    # -- tables ----------------------------------------------------------------------------------

    def _create_tables(self) -> None:
        """Each table, created empty with this version's columns when no sidecar has yet (two
        sidecars racing to create one: the loser finds it made)."""
        with self.store.read() as con:
            for table in TABLES:
                uri = table_uri(self.location, table)
                if DeltaTable.is_deltatable(uri, storage_options()):
                    continue
                schema = as_delta(con.sql(select(table, "FALSE")).to_arrow_table()).schema
                with suppress(CommitFailedError):  # another sidecar created it first
                    DeltaTable.create(
                        uri, schema, mode="ignore",
                        partition_by=[RUN_KEY] if table in PARTITIONED else None,
                        name=f"servescope_{table}", storage_options=storage_options(),
                    )  # fmt: skip

    def table(self, name: str) -> DeltaTable:
        found = self._tables.get(name)
        if found is None:
            found = DeltaTable(table_uri(self.location, name), storage_options=storage_options())
            self._tables[name] = found
        else:
            found.update_incremental()
        return found

    def _written(self, name: str, seq: int) -> bool:
        """Whether the lake holds flush `seq` of this sidecar in table `name`."""
        try:
            return (self.table(name).transaction_version(self.app_id) or 0) >= seq
        except TableNotFoundError:
            return False

    # -- the flush's transaction -----------------------------------------------------------------

    def mark(self, con: duckdb.DuckDBPyConnection) -> Mark:
        """Where the tables stand (first thing in a flush's transaction, which still sees the
        store as the last flush left it), once a write in flight is done or made good."""
        self._settle(con)
        rowids = {}
        for table in ("events", "metric_samples", "lever_flips", "runtime_events"):
            rowids[table] = count(con, f"SELECT COALESCE(max(rowid), -1) FROM {table}")  # noqa: S608
        return Mark(rowids, count(con, "SELECT count(*) FROM events"))

    def owe(
        self,
        con: duckdb.DuckDBPyConnection,
        mark: Mark,
        *,
        runs: Iterable[str] = (),
        flip_groups: Iterable[tuple[str, str]] = (),
    ) -> Owed | None:
        """What this transaction changed, with the flushes not yet written, saved in the store
        with it as flush `seq + 1`; None when it changed nothing the lake holds."""
        owed = Owed(self.seq + 1, dict(mark.rowids), runs=sorted(set(runs)))
        after = mark.rowids["events"]
        touched = count(con, f"SELECT count(*) FROM events WHERE rowid > {after}")  # noqa: S608
        new = count(con, "SELECT count(*) FROM events") - mark.events
        if touched >= FRESH_ROWS and touched == new and self._owed is None:
            # a backlog's flush, every request new: read after the commit, off the collector's
            # path, and written at once (before the next flush can move a rowid)
            owed.fresh = touched
            owed.touched = [r for (r,) in con.execute(
                f"SELECT DISTINCT run_id FROM events WHERE rowid > {after}"  # noqa: S608
            ).fetchall()]  # fmt: skip
        elif touched:
            owed.held = self._rows(con, "events", f"rowid > {after}")
            owed.touched = sorted(set(owed.held.column("run_id").to_pylist()), key=str)
        if touched != new:
            self._note_updates(con, mark, owed)
        owed.flips = changed_flips(con, mark, list(flip_groups))
        if not (touched or owed.moved or owed.runs or owed.flips or any(
            count(con, f"SELECT count(*) FROM {t} WHERE rowid > {mark.rowids[t]}")  # noqa: S608
            for t in ("metric_samples", "runtime_events")
        )):  # fmt: skip
            return None
        if self._owed is not None:
            owed = self._owed.then(owed)
        self._save(con, LakeState(sidecar=self.sidecar, seq=owed.seq, owed=owed.state()))
        return owed

    def _note_updates(self, con: duckdb.DuckDBPyConnection, mark: Mark, owed: Owed) -> None:
        """Some requests this flush touched were stored before (its trace after its log line),
        perhaps under another run: their rows as they were, on a second connection whose
        snapshot does not see this transaction, are the rows the lake holds of them."""
        after = mark.rowids["events"]
        ids = [r for (r,) in con.execute(
            f"SELECT DISTINCT request_id FROM events WHERE rowid > {after}"  # noqa: S608
        ).fetchall()]  # fmt: skip
        with con.cursor() as before:
            prior = before.execute(
                "SELECT e.run_id, e.request_id, e.ts FROM events e"
                " JOIN (SELECT unnest($1::VARCHAR[]) AS request_id) k USING (request_id)",
                [ids],
            ).fetchall()
        if not prior:
            return
        now = set(con.execute(
            "SELECT e.run_id, e.request_id FROM events e"
            " JOIN (SELECT unnest($1::VARCHAR[]) AS request_id) k USING (request_id)", [ids],
        ).fetchall())  # fmt: skip
        owed.updated = sorted((r, q) for r, q, _ts in prior if (r, q) in now)
        owed.moved = sorted((r, q) for r, q, _ts in prior if (r, q) not in now)
        times = [ts for _r, _q, ts in prior]
        if all(isinstance(ts, datetime) for ts in times):
            # a second below the earliest: file statistics round timestamps
            owed.since = (min(times) - timedelta(seconds=1)).isoformat()

    def committed(self, owed: Owed | None) -> None:
        """The store committed flush `owed.seq` (with those before it not yet written): they go
        to the lake on a thread, while the collector reads on, once `interval_s` has passed
        since the last write or they hold `HELD_ROWS` requests (the next flush waits for the
        thread in `mark`)."""
        if owed is None:
            return
        self.seq = owed.seq
        self._owed = owed
        if not (self._waited() or owed.fresh or owed.rows >= HELD_ROWS):
            return
        pending = _Pending(owed)
        self._pending = pending
        threading.Thread(
            target=self._write_after_commit, args=(pending,), name="servescope-lake", daemon=True
        ).start()

    def _write_after_commit(self, pending: _Pending) -> None:
        try:
            with self.store.snapshot() as con:
                self._write(con, pending.owed)
        except BaseException as exc:  # written again by the next flush, which says why
            pending.error = exc
            log.debug("lake: writing flush %d after its commit failed", pending.owed.seq,
                      exc_info=exc)  # fmt: skip
        finally:
            pending.done.set()

    def _settle(self, con: duckdb.DuckDBPyConnection) -> None:
        """The write in flight done, or made good from `con` (which sees the store as the last
        flush left it) when the thread failed; raises when it cannot (a full disk): the flush
        that called it fails and is tried again. A commit that raised after it happened (the
        store says a later flush than this writer knows) is adopted here."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.done.wait()
            if pending.error is None:
                self._written_up_to(pending.owed)
            else:
                self._failed = True
        if self._failed:  # written as it was tried, never with later flushes: a table may have it
            self._drain(con)
        if int(self._state_of(con).get("seq") or 0) != self.seq:
            self._adopt(con)

    def _written_up_to(self, owed: Owed | None) -> None:
        self._failed = False
        if owed is None:
            return
        self._last_write = time.monotonic()
        if self._owed is not None and self._owed.seq == owed.seq:
            self._owed = None

    def _adopt(self, con: duckdb.DuckDBPyConnection) -> None:
        """The store's word on what the lake is owed (at a start, or after a commit raised)."""
        state = self._state_of(con)
        self.seq = int(state.get("seq") or 0)
        self._owed = Owed.from_state(state["owed"]) if state.get("owed") else None

    def _drain(self, con: duckdb.DuckDBPyConnection) -> None:
        """Every committed flush whole in the lake now, from `con`; raises when it cannot."""
        self.wait()
        owed = self._owed
        if owed is not None:
            self._write(con, owed)
        self._written_up_to(owed)

    def behind(self) -> bool:
        """Whether the lake needs a write with no new flush to carry it: a write failed, or
        committed flushes have waited past the interval (a trickle that stopped)."""
        pending = self._pending
        if pending is not None:
            return pending.done.is_set() and pending.error is not None
        return self._failed or (self._owed is not None and self._waited())

    def _waited(self) -> bool:
        """Whether `interval_s` has passed since the last write (or none was made yet: the
        monotonic clock counts from boot, so a zero would hold a young machine's first flush)."""
        last = self._last_write
        return last is None or time.monotonic() - last >= self.interval_s

    def drain(self) -> None:
        """Every committed flush whole in the lake (before retention deletes store rows whose
        rowids an unwritten flush counts on; when the collector stops)."""
        with self.store.snapshot() as con:
            self._settle(con)
            self._drain(con)

    def wait(self) -> None:
        """Until the write in flight is done (written or failed)."""
        pending = self._pending
        if pending is not None:
            pending.done.wait()

    def close(self) -> None:
        """Every committed flush written before the collector stops (or left for the next
        start, which writes it, when that fails)."""
        try:
            self.drain()
        except (DeltaError, OSError, pa.ArrowException, duckdb.Error, StoreBusy) as exc:
            log.warning("lake: flush %d is not written yet (%s); the next start writes it",
                        self.seq, exc)  # fmt: skip

    # -- writing a flush -------------------------------------------------------------------------

    def _write(self, con: duckdb.DuckDBPyConnection, owed: Owed) -> None:
        """Flush `owed.seq` into each table that does not hold it yet, one commit a table."""
        txn = CommitProperties(app_transactions=[Transaction(self.app_id, owed.seq)])
        for name in TABLES:  # each writer skips a table that holds it (`_written`)
            write: Callable[[duckdb.DuckDBPyConnection, Owed, CommitProperties, str], None]
            write = getattr(self, f"_write_{name}")
            retry_commit(partial(write, con, owed, txn, name), name)

    def _rows(self, con: duckdb.DuckDBPyConnection, table: str, where: str,
              params: Any = None) -> pa.Table:  # fmt: skip
        rows = as_delta(con.sql(select(table, where), params=params).to_arrow_table())
        if RUN_KEY in rows.column_names:
            self.touched.update(str(k) for k in rows.column(RUN_KEY).unique().to_pylist())
        return rows

    def _append(
        self, con: duckdb.DuckDBPyConnection, owed: Owed, txn: CommitProperties, name: str
    ) -> None:
        if self._written(name, owed.seq):  # a retry after a commit that did happen
            return
        rows = self._rows(con, name, f"rowid > {owed.after[name]}")
        if rows.num_rows:  # no commit for nothing (a start finds nothing to write either)
            write_deltalake(self.table(name), rows, mode="append", schema_mode="merge",
                            commit_properties=txn)  # fmt: skip

    _write_metric_samples = _append
    _write_runtime_events = _append

    def _write_events(
        self, con: duckdb.DuckDBPyConnection, owed: Owed, txn: CommitProperties, name: str
    ) -> None:
        if self._written(name, owed.seq):
            return
        since = owed.since
        if owed.fresh:
            rows = self._rows(con, name, f"rowid > {owed.after[name]}")
            if rows.num_rows == owed.fresh:  # no rowid moved since the flush (nothing deleted)
                write_deltalake(self.table(name), rows, mode="append", schema_mode="merge",
                                commit_properties=txn)  # fmt: skip
                return
            log.warning("lake: flush %d's rows moved in the store; its runs are merged whole",
                        owed.seq)  # fmt: skip
            rows = self._rows(con, name, "list_contains($1, run_id)", [owed.touched])
            since = None
        elif owed.held is not None:
            rows = owed.held
            if not (owed.updated or owed.moved):
                write_deltalake(self.table(name), rows, mode="append", schema_mode="merge",
                                commit_properties=txn)  # fmt: skip
                return
        elif owed.touched or owed.moved:  # lost with the process: its runs' rows, merged whole
            rows = self._rows(con, name, "list_contains($1, run_id)", [owed.touched])
            since = None
        else:
            return
        rows = rows.append_column("lake_delete", pa.repeat(False, rows.num_rows))
        if owed.moved:
            gone = pa.table({
                "run_id": [r for r, _q in owed.moved],
                "request_id": [q for _r, q in owed.moved],
                RUN_KEY: [run_key(r) for r, _q in owed.moved],
                "lake_delete": [True] * len(owed.moved),
            })  # fmt: skip
            rows = pa.concat_tables([rows, gone], promote_options="default")
        on = "t.run_key = s.run_key AND t.run_id = s.run_id AND t.request_id = s.request_id"
        if since is not None:
            on += f" AND t.ts >= '{sql_literal(since)}Z'"
        (
            self.table(name)
            .merge(
                rows,
                on,
                source_alias="s",
                target_alias="t",
                merge_schema=True,
                commit_properties=txn,
            )  # fmt: skip
            .when_matched_delete("s.lake_delete")
            .when_matched_update_all("NOT s.lake_delete", except_cols=["lake_delete"])
            .when_not_matched_insert_all("NOT s.lake_delete", except_cols=["lake_delete"])
            .execute()
        )

    def _write_runs(
        self, con: duckdb.DuckDBPyConnection, owed: Owed, txn: CommitProperties, name: str
    ) -> None:
        if not owed.runs or self._written(name, owed.seq):
            return
        rows = self._rows(con, name, "list_contains($1, run_id)", [owed.runs])
        (
            self.table(name)
            .merge(
                rows,
                "t.run_id = s.run_id",
                source_alias="s",
                target_alias="t",
                merge_schema=True,
                commit_properties=txn,
            )  # fmt: skip
            .when_matched_update_all()
            .when_not_matched_insert_all()
            .execute()
        )

    def _write_lever_flips(
        self, con: duckdb.DuckDBPyConnection, owed: Owed, txn: CommitProperties, name: str
    ) -> None:
        """Each changed restart's whole set of flips, in place of the set the lake had (an
        empty set deletes it)."""
        if not owed.flips or self._written(name, owed.seq):
            return
        keys = [[r for r, _b in owed.flips], [b for _r, b in owed.flips]]
        rows = self._rows(
            con, name,
            "(run_id, before_run_id) IN (SELECT unnest($1::VARCHAR[]), unnest($2::VARCHAR[]))",
            keys,
        )  # fmt: skip
        predicate = " OR ".join(
            f"(run_id = '{sql_literal(r)}' AND before_run_id = '{sql_literal(b)}')"
            for r, b in owed.flips
        )
        write_deltalake(self.table(name), rows, mode="overwrite", predicate=predicate,
                        schema_mode="merge", commit_properties=txn)  # fmt: skip
