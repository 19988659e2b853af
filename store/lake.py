"""The shared Parquet lake: what many sidecars on many hosts write into one folder, and what
`report build --lake`, DuckDB, ClickHouse, Spark or Trino read in place.

Layout (the hive layout of `store export --format parquet`, one folder per table):

    LAKE/<table>/run_id=<run>/date=<YYYY-MM-DD>/part-<sidecar>-<seq>.parquet
    LAKE/<table>/run_id=<run>/date=<YYYY-MM-DD>/merged-<sidecar>-<lo>-<hi>.parquet
    LAKE/_schema/<table>/<sidecar>.<digest>.parquet   (no rows: the columns this version writes)

`<table>` is `events`, `metric_samples`, `runs`, `lever_flips` or `runtime_events`. `<sidecar>`
is made once per store (host name and a random 48-bit id, kept in the store's checkpoints), so
sidecars never need to agree on anything and never write the same name; `<seq>` is the flush's
sequence number, 12 digits. A file is written under `LAKE/.staging/` and renamed into place, so
it is there whole or not at all. Every file also holds `run_id` and `date` as columns, so an
engine that reads no hive partitions still has them. `<run>` is the run id percent-encoded
(`store.paths.safe_name`); an id that encoding cannot carry (too long for a folder, empty,
Hive's null marker) lives under a folder whose name has a `~` (`store.paths.partition_value`),
and is read from the file's own `run_id` column. `date` is the UTC day of the row's `ts`
(`__HIVE_DEFAULT_PARTITION__` without one); a NULL run id is `__HIVE_DEFAULT_PARTITION__` too.

Exactly once with the store (`LakeWriter`): flush k writes its files *inside* the store
transaction that commits flush k, just before the commit, and the transaction also saves
"flush k written" in the store's checkpoints. A crash before the files are renamed leaves only
staging files (removed at the next start); a crash between the rename and the commit leaves
files of flush k that the store never committed: the next start removes this sidecar's files
with a sequence above the last committed one before anything else, and flush k is written
again from what the collector reads again. A failed flush (a full disk) removes what it wrote.

Except a flush's new requests (every request it touched is new: a backlog, a bench's records),
whose events file is the bulk of a flush's Parquet: their transaction saves "flush k's events
pending" (which rows: the `events` rowids past the flush's start, their count and their runs,
and their version) and commits without them; a thread writes them from the committed
store right after, while the collector reads on, and flush k + 1's transaction waits for it
before it commits, saying "flush k's events written" (and writes them itself when the thread
could not, a full disk). So the store holds at most one flush the lake lacks, and only ever
its last one: a start that finds "pending" removes that flush's events files (a crash may have
cut them short) and writes them again from the store, which is still as flush k left it.
(DuckDB keeps rowids and gives a commit's rows the rowids after every committed one; should the
rows past the start not be the count saved, the pending events are written as every row of
their runs, each marked as an update: the lake's one rule still picks one row per request.)

Versions: a request's pieces can reach the store in several flushes (a log line, then its
trace), and the store merges them into one row; the lake gets the merged row of every flush
that touched it. Each row carries `lake_version` (`<commit µs>.<sidecar>.<seq>`: the flush
that wrote it, ordered by time), `lake_update` (true when the request was already stored
before that flush: an older version of it may be in the lake) and `lake_deleted` (a tombstone:
the request left this run, as a trace's request kept under `vllm-unattributed` does when its
session is known). **The one rule for every reader: per (run_id, request_id) the row with the
greatest `lake_version` is the request, unless it is a tombstone.** servescope's reader applies
it only to requests with an update (few: a bench run's client records have none), which costs
nothing when there are none. `runs` rows are written whole (the latest version per run_id
wins); `lever_flips` as the whole set of a restart's flips (per (run_id, before_run_id) the
latest version's rows, a row with a NULL lever saying "none"); `metric_samples` and
`runtime_events` are appended once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

import duckdb

from servescope.store import checkpoints, queries
from servescope.store.paths import MAX_NAME, name_of, partition_value, safe_name

if TYPE_CHECKING:
    from servescope.store.db import Store

log = logging.getLogger("servescope.lake")

NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"
STAGING = ".staging"
SCHEMA = "_schema"
SEQ_DIGITS = 12
# zstd at its fastest level: a flush's copy is on the collector's path (level 3, the default,
# costs ~25 % more CPU for files 3 % smaller); compaction writes at the default level
COMPRESSION = "zstd, COMPRESSION_LEVEL 1"
LAKE_COLUMNS = ("lake_version", "lake_update", "lake_deleted")

# Each table's columns, named (as the store's inserts name theirs): a sidecar of this version
# writes exactly these whatever columns a newer servescope has added to its store, so files of
# one version share one schema and readers need no schema merging between them.
_COLUMNS: dict[str, str] = {
    "events": "",  # the schema's (store.schema_sql.event_columns), read by the writer alone
    "metric_samples": "ts, target, name, labels, run_id, value",
    "runs": "run_id, started_at, ended_at, label, target, model, vllm_version,"
    " CAST(levers AS VARCHAR) AS levers, CAST(workload AS VARCHAR) AS workload, status,"
    " CAST(notes AS VARCHAR) AS notes",
    "lever_flips": "ts, lever, run_id, before, after, note, before_run_id",
    "runtime_events": "run_id, event_id, type, ts, request_id, trace_id, after_request_id,"
    " ingested_at, seq, CAST(doc AS VARCHAR) AS doc",
}


def table_columns(table: str) -> str:
    """The columns the lake holds of `table`, as a SELECT list."""
    if table == "events":
        from servescope.store import schema_sql  # the writer's (a reader never needs it)

        return ", ".join(f'"{name}"' for name, _type in schema_sql.event_columns())
    return _COLUMNS[table]


TABLES = tuple(_COLUMNS)
# The column a row's `date` partition is the UTC day of.
DATE_COLUMN = {"runs": "started_at"}

# `.<k>` numbers the files of one flush in one partition when DuckDB writes it in several.
_PART = re.compile(r"^part-(?P<sidecar>.+)-(?P<lo>\d{12})(?:\.\d+)?\.parquet$")
_MERGED = re.compile(r"^merged-(?P<sidecar>.+)-(?P<lo>\d{12})-(?P<hi>\d{12})(?:\.\d+)?\.parquet$")


# -- names ---------------------------------------------------------------------------------------


def run_folder(run_id: str | None) -> str:
    """The `run_id=` folder value of a run: its percent-encoded id, which every hive reader
    decodes back to the id; else (an id the encoding cannot carry) a name with a `~`."""
    if run_id is None:
        return NULL_PARTITION
    name = safe_name(run_id)
    if (
        run_id
        and run_id != NULL_PARTITION
        and "~" not in name
        and len(name) <= MAX_NAME - len("run_id=")
        and name_of(name) == run_id
        and run_id.isprintable()
    ):
        return name
    value = partition_value(run_id)
    if value != run_id:  # too long: its head, and a digest of the whole id
        head, _, digest = value.rpartition("~")
        return f"{safe_name(head)}~{digest}"
    return f"{safe_name(run_id)}~"


def hived(folder_value: str) -> bool:
    """A `run_id=` folder whose name a hive reader decodes to the run id (no `~`)."""
    return "~" not in folder_value


@dataclass(frozen=True)
class LakeFile:
    """One data file of the lake, known by its name: whose, and which flushes it holds."""

    path: Path
    table: str
    sidecar: str
    lo: int
    hi: int
    merged: bool

    @property
    def partition(self) -> Path:
        return self.path.parent


def parse_name(path: Path, table: str) -> LakeFile | None:
    match = _PART.match(path.name)
    if match:
        seq = int(match["lo"])
        return LakeFile(path, table, match["sidecar"], seq, seq, False)
    match = _MERGED.match(path.name)
    if match:
        return LakeFile(path, table, match["sidecar"], int(match["lo"]), int(match["hi"]), True)
    return None


def part_name(sidecar: str, seq: int, k: int = 0) -> str:
    index = f".{k}" if k else ""
    return f"part-{sidecar}-{seq:0{SEQ_DIGITS}d}{index}.parquet"


def merged_name(sidecar: str, lo: int, hi: int, k: int = 0) -> str:
    index = f".{k}" if k else ""
    return f"merged-{sidecar}-{lo:0{SEQ_DIGITS}d}-{hi:0{SEQ_DIGITS}d}{index}.parquet"


def list_files(
    root: Path,
    table: str,
    run_folders: Iterable[str] | None = None,
    date_ok: Callable[[str], bool] | None = None,
) -> list[LakeFile]:
    """The data files of one table (of some runs' folders, some `date=` folders, when given),
    without those a merged file covers: a reader never sees a row twice while compaction
    removes parts (store/lakecompact.py)."""
    base = root / table
    if run_folders is None:
        folders = [p for p in subdirs(base) if p.name.startswith("run_id=")]
    else:
        folders = [base / f"run_id={value}" for value in run_folders]
    found: list[LakeFile] = []
    for folder in folders:
        for partition in subdirs(folder):
            if date_ok is not None and not date_ok(partition.name.partition("=")[2]):
                continue
            found.extend(visible(files_in(partition, table)))
    return found


def subdirs(path: Path) -> list[Path]:
    try:
        with os.scandir(path) as entries:
            return [Path(e.path) for e in entries if e.is_dir() and not e.name.startswith(".")]
    except (FileNotFoundError, NotADirectoryError):
        return []


def files_in(partition: Path, table: str) -> list[LakeFile]:
    try:
        with os.scandir(partition) as entries:
            names = [e.name for e in entries if e.name.endswith(".parquet")]
    except (FileNotFoundError, NotADirectoryError):
        return []
    files = (parse_name(partition / n, table) for n in names)
    return [f for f in files if f is not None]


def visible(files: Sequence[LakeFile]) -> list[LakeFile]:
    """Files not covered by another file of the same sidecar with a wider range of flushes."""
    merged = [f for f in files if f.merged]
    out = []
    for f in files:
        covered = any(
            m is not f and m.sidecar == f.sidecar and m.lo <= f.lo and f.hi <= m.hi
            and (m.lo, m.hi) != (f.lo, f.hi)
            for m in merged
        )  # fmt: skip
        if not covered:
            out.append(f)
    return out


def schema_name(sidecar: str, table: str) -> str:
    """`<sidecar>.<digest of the columns>.parquet`: one per sidecar and servescope version."""
    digest = hashlib.sha256(table_columns(table).encode()).hexdigest()[:8]
    return f"{sidecar}.{digest}.parquet"


def new_sidecar_id() -> str:
    """This store's name in the lake: the host (for people) and 48 random bits (for
    uniqueness); only `[A-Za-z0-9.]` and `_`, so it never breaks a file name."""
    host = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())[:40] or "host"
    return f"{host}_{secrets.token_hex(6)}"


# -- writing -------------------------------------------------------------------------------------


@dataclass
class Mark:
    """Where the store's tables stood when a flush began (inside its transaction)."""

    rowids: dict[str, int]
    events: int


@dataclass
class Written:
    """The files one flush wrote (renamed into place), and the rows per table; its events, when
    they are written after the commit (`deferred`), and the earlier flush whose deferred events
    its transaction said were written (`settles`)."""

    seq: int
    paths: list[Path] = field(default_factory=list)
    rows: dict[str, int] = field(default_factory=dict)
    deferred: Deferred | None = None
    settles: Deferred | None = None


@dataclass
class Deferred:
    """A flush's events, committed in the store, written to the lake after the commit: the
    `events` rows past rowid `after` (the flush's start; a commit gives its rows the rowids
    after every committed one), `rows` of them, of these runs, at this version."""

    seq: int
    version: str
    after: int
    rows: int
    runs: list[str | None]
    done: threading.Event = field(default_factory=threading.Event)
    written: bool = False  # by the thread, whole
    error: BaseException | None = None

    def state(self) -> dict[str, Any]:
        return {"seq": self.seq, "version": self.version, "after": self.after, "rows": self.rows,
                "runs": self.runs}  # fmt: skip

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Deferred:
        return cls(int(state["seq"]), str(state["version"]), int(state["after"]),
                   int(state["rows"]), list(state["runs"]))  # fmt: skip


class LakeWriter:
    """Appends each committed flush of one store to the lake (see the module docstring).

    `mark(con)` at the start of the flush's transaction; `write(con, mark, …)` just before its
    commit; `committed(written)` after the commit, `failed(written)` after a rollback.
    """

    def __init__(self, root: str | Path, store: Store) -> None:
        self.root = Path(root).resolve()
        self.store = store
        self.source = f"lake:{self.root}"
        state = checkpoints.state_of(checkpoints.load(store, self.source))
        self.sidecar: str = state.get("sidecar") or self._name_sidecar()
        self.seq: int = int(state.get("seq") or 0)  # the last flush the store committed
        self._clock = 0
        self._unsettled: list[Written] = []
        # the last flush's events, written after its commit and not yet said written
        self._deferred = Deferred.from_state(state["deferred"]) if state.get("deferred") else None
        self.root.mkdir(parents=True, exist_ok=True)
        self.remove_uncommitted()
        self._write_schema()
        if self._deferred is not None:  # a crash before the store said they were written
            self._deferred.done.set()  # no thread writes them: this start does
            self.settle_deferred()

    def _name_sidecar(self) -> str:
        """A new store's name in the lake, committed before any file carries it: a crash in its
        first flush leaves files a restart knows as its own (`remove_uncommitted`)."""
        sidecar = new_sidecar_id()
        with self.store.write() as con:
            row = {"file_key": checkpoints.STATE_KEY, "state": {"sidecar": sidecar, "seq": 0}}
            checkpoints.save(con, self.source, [row])
        return sidecar

    @property
    def published(self) -> int:
        """The last flush whose files are all in the lake and said so (compaction's bound)."""
        return self.seq - 1 if self._deferred is not None else self.seq

    @property
    def staging(self) -> Path:
        return self.root / STAGING / self.sidecar

    def remove_uncommitted(self) -> int:
        """Remove this sidecar's files of flushes the store never committed (a crash between
        the rename and the commit) and its staging files; returns how many files went."""
        removed = 0
        shutil.rmtree(self.staging, ignore_errors=True)
        for table in TABLES:
            for folder in subdirs(self.root / table):
                for partition in subdirs(folder):
                    for found in files_in(partition, table):
                        if (
                            found.sidecar == self.sidecar
                            and not found.merged
                            and (found.lo > self.seq or self._unwritten(found))
                        ):
                            found.path.unlink(missing_ok=True)
                            removed += 1
        if removed:
            log.info("lake: removed %d files of flushes the store had not committed", removed)
        return removed

    def _unwritten(self, found: LakeFile) -> bool:
        """An events file of the deferred flush, which the store does not say is whole."""
        return (
            self._deferred is not None
            and found.table == "events"
            and found.lo == self._deferred.seq
            and not self._deferred.written
        )

    def _write_schema(self) -> None:
        """`_schema/<table>/<sidecar>.parquet`: the columns this version writes, no rows; what a
        reader reads a table from before any data file exists, and how it sees versions differ."""
        with self.store.read() as con:
            for table in TABLES:
                target = self.root / SCHEMA / table / schema_name(self.sidecar, table)
                if target.exists():
                    continue
                if not _table_exists(con, table):
                    continue
                select = _select(table, "FALSE")
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
                con.execute(
                    f"COPY ({select} LIMIT 0) TO '{sql_literal(tmp)}' (FORMAT parquet)"  # noqa: S608
                )
                os.replace(tmp, target)

    def mark(self, con: duckdb.DuckDBPyConnection) -> Mark:
        rowids = {}
        for table in ("events", "metric_samples", "lever_flips", "runtime_events"):
            if _table_exists(con, table):
                row = con.execute(f"SELECT COALESCE(max(rowid), -1) FROM {table}").fetchone()  # noqa: S608
                rowids[table] = int(row[0]) if row else -1
        count = con.execute("SELECT count(*) FROM events").fetchone()
        return Mark(rowids, int(count[0]) if count else 0)

    def write(
        self,
        con: duckdb.DuckDBPyConnection,
        mark: Mark,
        *,
        runs: Iterable[str] = (),
        flip_groups: Iterable[tuple[str, str]] = (),
    ) -> Written | None:
        """Write what this transaction changed as flush `seq + 1` (its new requests' events
        after the commit: `committed`), and save that number in the store's checkpoints (in the
        same transaction). None when nothing changed and nothing was pending."""
        self._settle(con)
        seq = self.seq + 1
        self._clock = max(self._clock + 1, time.time_ns() // 1000)
        version = f"{self._clock:017d}.{self.sidecar}.{seq:0{SEQ_DIGITS}d}"
        staged = self.staging / f"{seq:0{SEQ_DIGITS}d}"
        shutil.rmtree(staged, ignore_errors=True)
        written = Written(seq)
        try:
            written.settles = self._catch_up(con, written)
            self._stage_all(con, mark, version, staged, list(runs), list(flip_groups), written)
            if not written.rows and written.deferred is None:
                shutil.rmtree(staged, ignore_errors=True)
                if written.settles is None:
                    return None
                written.seq = self.seq  # no flush of its own: says the pending one is written
            else:
                self._publish(staged, seq, written)
            state: dict[str, Any] = {"sidecar": self.sidecar, "seq": written.seq}
            if written.deferred is not None:
                state["deferred"] = written.deferred.state()
            checkpoints.save(
                con, self.source, [{"file_key": checkpoints.STATE_KEY, "state": state}]
            )
        except BaseException:
            for path in written.paths:  # not committed: the store is not saying otherwise yet
                path.unlink(missing_ok=True)
            written.paths.clear()
            shutil.rmtree(staged, ignore_errors=True)
            raise
        con.execute("DROP TABLE IF EXISTS lake_stage")
        return written

    def _catch_up(self, con: duckdb.DuckDBPyConnection, written: Written) -> Deferred | None:
        """The previous flush's deferred events, whole in the lake before this transaction says
        so: the thread's files, or written here when the thread could not (a full disk), from
        the store as that flush left it (a second connection, which does not see this
        transaction)."""
        deferred = self._deferred
        if deferred is None:
            return None
        deferred.done.wait()
        if not deferred.written:
            self._remove_events_of(deferred.seq)
            with con.cursor() as before:
                written.paths.extend(self._write_deferred(before, deferred))
        return deferred

    def _remove_events_of(self, seq: int) -> None:
        for folder in subdirs(self.root / "events"):
            for partition in subdirs(folder):
                for found in files_in(partition, "events"):
                    if found.sidecar == self.sidecar and not found.merged and found.lo == seq:
                        found.path.unlink(missing_ok=True)

    def _write_deferred(self, con: duckdb.DuckDBPyConnection, deferred: Deferred) -> list[Path]:
        """Write a deferred flush's events (as a flush of its own number) and publish them."""
        where = f"rowid > {deferred.after}"
        if _count(con, f"SELECT count(*) FROM events WHERE {where}") == deferred.rows:  # noqa: S608
            select = _select("events", where, deferred.version)
        else:  # the rows moved (no DuckDB does that yet): every row of their runs, as updates
            log.warning("lake: flush %d's rows moved in the store; its runs written again whole",
                        deferred.seq)  # fmt: skip
            con.execute("CREATE OR REPLACE TEMP TABLE lake_keys (run_id VARCHAR)")
            con.execute("INSERT INTO lake_keys SELECT unnest($1::VARCHAR[])", [deferred.runs])
            where = "run_id IN (SELECT run_id FROM lake_keys)"
            if None in deferred.runs:
                where += " OR run_id IS NULL"
            select = _select("events", where, deferred.version).replace(
                "false AS lake_update", "true AS lake_update"
            )
        staged = self.staging / f"{deferred.seq:0{SEQ_DIGITS}d}-events"
        shutil.rmtree(staged, ignore_errors=True)
        done = Written(deferred.seq)
        try:
            self._stage(con, "events", select, staged, done)
            self._publish(staged, deferred.seq, done)
        except BaseException:
            for path in done.paths:
                path.unlink(missing_ok=True)
            shutil.rmtree(staged, ignore_errors=True)
            raise
        return done.paths

    def _write_after_commit(self, deferred: Deferred) -> None:
        """The thread: a deferred flush's events from the committed store (a transaction of its
        own, which sees the store as that flush left it: the next flush waits for this one)."""
        try:
            with self.store.snapshot() as con:
                self._write_deferred(con, deferred)
            deferred.written = True
        except BaseException as exc:  # written again by the next transaction, which says why
            deferred.error = exc
            log.debug("lake: writing flush %d's events after its commit failed", deferred.seq,
                      exc_info=exc)  # fmt: skip
        finally:
            deferred.done.set()

    def settle_deferred(self) -> None:
        """Make the pending deferred events whole in the lake and say so in the store (at a
        start after a crash, and when the collector stops); a failure leaves them pending, for
        the next flush or start."""
        if self._deferred is None:
            return
        try:
            with self.store.write() as con:
                written = Written(self.seq)
                written.settles = self._catch_up(con, written)
                state = {"sidecar": self.sidecar, "seq": self.seq}
                checkpoints.save(
                    con, self.source, [{"file_key": checkpoints.STATE_KEY, "state": state}]
                )
        except Exception as exc:
            log.warning("lake: flush %d's events are not written yet (%s); the next flush or "
                        "start writes them", self.seq, exc)  # fmt: skip
            self._deferred.written = False
            return
        self._deferred = None

    def wait(self) -> None:
        """Until the last flush's events are written after its commit (or failed to be)."""
        deferred = self._deferred
        if deferred is not None:
            deferred.done.wait()

    def close(self) -> None:
        """Wait for the last flush's events and say they are written."""
        self.settle_deferred()

    def committed(self, written: Written | None) -> None:
        if written is None:
            return
        self.seq = written.seq
        if written.settles is not None:
            self._deferred = None
        if written.deferred is not None:
            self._deferred = written.deferred
            threading.Thread(
                target=self._write_after_commit, args=(written.deferred,),
                name="servescope-lake", daemon=True,
            ).start()  # fmt: skip

    def failed(self, written: Written | None) -> None:
        """The flush's transaction raised. Its files stay until the next flush's transaction
        reads whether the store did commit it (a commit can succeed and its connection still
        fail to close): kept if so, removed if not (`_settle`)."""
        if written is not None and written.paths:
            self._unsettled.append(written)
        if written is not None and written.settles is not None:
            written.settles.written = False  # written again by the next transaction

    def _settle(self, con: duckdb.DuckDBPyConnection) -> None:
        if not self._unsettled:
            return
        rows = con.execute(queries.LIST_CHECKPOINTS, {"source": self.source}).fetchall()
        stored: dict[str, Any] = {}
        for row in rows:
            if row[1] == checkpoints.STATE_KEY and row[6]:
                stored = json.loads(row[6])
        for written in self._unsettled:
            if written.seq <= int(stored.get("seq") or 0):  # committed after all
                self.seq = max(self.seq, written.seq)
                if written.settles is not None:
                    self._deferred = None
                if written.deferred is not None and stored.get("deferred"):
                    self._deferred = written.deferred  # not started: written by `_catch_up`
                    self._deferred.done.set()
            else:
                for path in written.paths:
                    path.unlink(missing_ok=True)
        self._unsettled.clear()

    # -- the tables ------------------------------------------------------------------------------

    def _stage_all(
        self,
        con: duckdb.DuckDBPyConnection,
        mark: Mark,
        version: str,
        staged: Path,
        runs: list[str],
        flip_groups: list[tuple[str, str]],
        written: Written,
    ) -> None:
        self._stage_events(con, mark, version, staged, written)
        for table in ("metric_samples", "runtime_events"):
            if table in mark.rowids:
                where = f"rowid > {int(mark.rowids[table])}"
                self._stage(con, table, _select(table, where, version), staged, written)
        if runs:
            con.execute("CREATE OR REPLACE TEMP TABLE lake_keys (run_id VARCHAR)")
            con.execute("INSERT INTO lake_keys SELECT unnest($1::VARCHAR[])", [runs])
            where = "run_id IN (SELECT run_id FROM lake_keys)"
            self._stage(con, "runs", _select("runs", where, version), staged, written)
        if flip_groups:
            self._stage_flips(con, mark, version, staged, flip_groups, written)

    def _stage_events(
        self,
        con: duckdb.DuckDBPyConnection,
        mark: Mark,
        version: str,
        staged: Path,
        written: Written,
    ) -> None:
        after = int(mark.rowids["events"])
        select = _select("events", f"rowid > {after}", version)
        touched = _count(con, f"SELECT count(*) FROM events WHERE rowid > {after}")  # noqa: S608
        now = _count(con, "SELECT count(*) FROM events")
        if touched == now - mark.events:  # every touched request is new: written as it is,
            if touched:  # after the commit (the module docstring)
                runs = [r for (r,) in con.execute(
                    f"SELECT DISTINCT run_id FROM events WHERE rowid > {after}"  # noqa: S608
                ).fetchall()]  # fmt: skip
                written.deferred = Deferred(written.seq, version, after, touched, runs)
            return
        # some touched requests were stored before this flush (updates), or left a run (moves):
        # found in the store as it was before the flush, on a second connection whose snapshot
        # does not see this transaction
        con.execute(f"CREATE OR REPLACE TEMP TABLE lake_stage AS {select}")  # noqa: S608
        self._mark_updates(con, version)
        self._stage(con, "events", "SELECT * FROM lake_stage", staged, written)

    def _mark_updates(self, con: duckdb.DuckDBPyConnection, version: str) -> None:
        ids = [r for (r,) in con.execute("SELECT DISTINCT request_id FROM lake_stage").fetchall()]
        with con.cursor() as before:
            prior = before.execute(
                "SELECT e.run_id, e.request_id FROM events e"
                " JOIN (SELECT unnest($1::VARCHAR[]) AS request_id) k USING (request_id)",
                [ids],
            ).fetchall()
        if not prior:
            return
        runs = [r for r, _ in prior]
        requests = [q for _, q in prior]
        con.execute("CREATE OR REPLACE TEMP TABLE lake_prior (run_id VARCHAR, request_id VARCHAR)")
        con.execute(
            "INSERT INTO lake_prior SELECT unnest($1::VARCHAR[]), unnest($2::VARCHAR[])",
            [runs, requests],
        )
        con.execute(
            """UPDATE lake_stage s SET lake_update = true FROM lake_prior p
               WHERE s.run_id = p.run_id AND s.request_id = p.request_id"""
        )
        # requests that were stored under a run and are no longer: a tombstone each
        con.execute(
            f"""INSERT INTO lake_stage BY NAME
            SELECT p.run_id, p.request_id, CAST(NULL AS DATE) AS date, '{sql_literal(version)}' AS
                   lake_version, true AS lake_update, true AS lake_deleted, '{{}}' AS doc
            FROM lake_prior p
            WHERE NOT EXISTS (SELECT 1 FROM events e
                              WHERE e.run_id = p.run_id AND e.request_id = p.request_id)"""  # noqa: S608
        )
        con.execute("DROP TABLE lake_prior")

    def _stage_flips(
        self,
        con: duckdb.DuckDBPyConnection,
        mark: Mark,
        version: str,
        staged: Path,
        groups: list[tuple[str, str]],
        written: Written,
    ) -> None:
        """The whole current set of each restart's flips that this flush rewrote, or a marker
        row (NULL lever) for a set that became empty."""
        params = [[g[0] for g in groups], [g[1] for g in groups]]
        after = int(mark.rowids.get("lever_flips", -1))
        changed = {
            tuple(r) for r in con.execute(_FLIP_GROUPS + f" AND rowid > {after}", params).fetchall()
        }
        now = {tuple(r) for r in con.execute(_FLIP_GROUPS, params).fetchall()}
        with con.cursor() as before:  # the store as it was before this flush
            had = {tuple(r) for r in before.execute(_FLIP_GROUPS, params).fetchall()}
        emptied = sorted(had - now)
        if not changed and not emptied:
            return
        keys = sorted(changed)
        where = "(run_id, before_run_id) IN (SELECT unnest($1::VARCHAR[]), unnest($2::VARCHAR[]))"
        select = _select("lever_flips", where, version)
        con.execute(
            f"CREATE OR REPLACE TEMP TABLE lake_flips AS {select}",  # noqa: S608
            [[k[0] for k in keys], [k[1] for k in keys]],
        )
        for run_id, before_run_id in emptied:
            con.execute(
                f"""INSERT INTO lake_flips BY NAME SELECT
                    CAST(now() AS TIMESTAMP) AS ts, $1 AS run_id, $2 AS before_run_id,
                    '{sql_literal(version)}' AS lake_version, false AS lake_update,
                    false AS lake_deleted""",  # noqa: S608
                [run_id, before_run_id],
            )
        self._stage(con, "lever_flips", "SELECT * FROM lake_flips", staged, written)
        con.execute("DROP TABLE lake_flips")

    def _stage(
        self,
        con: duckdb.DuckDBPyConnection,
        table: str,
        select: str,
        staged: Path,
        written: Written,
    ) -> None:
        """One table's rows into `staged/<table>/`, one file per (run folder, date)."""
        keys = con.execute(f"SELECT DISTINCT run_id, date FROM ({select})").fetchall()  # noqa: S608
        if not keys:
            return
        target = staged / table
        if len(keys) == 1:  # one partition (a backlog of one run): one plain COPY, a third cheaper
            run_id, day = keys[0]
            folder = (
                target
                / f"lake_run_folder={quote(run_folder(run_id), safe='')}"
                / f"lake_date_folder={day.isoformat() if day is not None else NULL_PARTITION}"
            )
            folder.mkdir(parents=True, exist_ok=True)
            copied = con.execute(
                f"COPY ({select}) TO '{sql_literal(folder / 'f0.parquet')}'"  # noqa: S608
                f" (FORMAT parquet, COMPRESSION {COMPRESSION})"
            ).fetchone()
            written.rows[table] = written.rows.get(table, 0) + (int(copied[0]) if copied else 0)
            return
        folders = {r: run_folder(r) for r in {k[0] for k in keys} if r is not None}
        staged.mkdir(parents=True, exist_ok=True)
        copied = con.execute(
            f"""COPY (
                SELECT s.*, COALESCE(m.folder, '{NULL_PARTITION}') AS lake_run_folder,
                       COALESCE(CAST(s.date AS VARCHAR), '{NULL_PARTITION}') AS lake_date_folder
                FROM ({select}) s
                LEFT JOIN (SELECT unnest($1::VARCHAR[]) AS rid, unnest($2::VARCHAR[]) AS folder) m
                    ON m.rid = s.run_id
            ) TO '{sql_literal(target)}' (FORMAT parquet, COMPRESSION {COMPRESSION},
                PARTITION_BY (lake_run_folder, lake_date_folder), FILENAME_PATTERN 'f{{i}}',
                OVERWRITE)""",  # noqa: S608 - folder names and the version are ours
            [list(folders), list(folders.values())],
        ).fetchone()
        rows = int(copied[0]) if copied else 0
        written.rows[table] = written.rows.get(table, 0) + rows

    def _publish(self, staged: Path, seq: int, written: Written) -> None:
        """Rename the staged files into their partitions (each whole, or not there)."""
        for table in TABLES:
            for folder in sorted((staged / table).glob("lake_run_folder=*/lake_date_folder=*")):
                run_value = unquote(folder.parent.name.split("=", 1)[1])
                date_value = unquote(folder.name.split("=", 1)[1])
                partition = self.root / table / f"run_id={run_value}" / f"date={date_value}"
                partition.mkdir(parents=True, exist_ok=True)
                for k, path in enumerate(sorted(folder.glob("*.parquet"))):
                    target = partition / part_name(self.sidecar, seq, k)
                    os.replace(path, target)
                    written.paths.append(target)
        shutil.rmtree(staged, ignore_errors=True)


_FLIP_GROUPS = """
SELECT DISTINCT run_id, before_run_id FROM lever_flips
WHERE (run_id, before_run_id) IN (SELECT unnest($1::VARCHAR[]), unnest($2::VARCHAR[]))
"""


def _select(table: str, where: str, version: str | None = None) -> str:
    """A table's rows as the lake holds them: its columns, the `date` partition, the lake's
    version columns (constants of this flush)."""
    date = DATE_COLUMN.get(table, "ts")
    lake = (
        f"'{sql_literal(version)}' AS lake_version, false AS lake_update, false AS lake_deleted"
        if version is not None
        else "CAST(NULL AS VARCHAR) AS lake_version, CAST(NULL AS BOOLEAN) AS lake_update,"
        " CAST(NULL AS BOOLEAN) AS lake_deleted"
    )
    return (
        f"SELECT {table_columns(table)}, CAST({date} AS DATE) AS date, {lake} "  # noqa: S608
        f"FROM {table} WHERE {where}"
    )


def _count(con: duckdb.DuckDBPyConnection, sql: str) -> int:
    row = con.execute(sql).fetchone()
    return int(row[0]) if row else 0


def _table_exists(con: duckdb.DuckDBPyConnection, table: str) -> bool:
    row = con.execute(
        "SELECT count(*) > 0 FROM duckdb_tables() WHERE table_name = $1", [table]
    ).fetchone()
    return bool(row and row[0])


def sql_literal(value: Any) -> str:
    """A value inside a single-quoted SQL literal (paths in COPY … TO, which takes no parameter)."""
    return str(value).replace("'", "''")
