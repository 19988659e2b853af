"""Reading a lake in place: a `Store` whose read connection's tables are views over the lake's
Parquet files, so every query of the store and the reports runs unchanged (`--lake DIR`).

`Lake.read()` opens an in-memory DuckDB connection and creates one view per table
(`events`, `runs`, `metric_samples`, `lever_flips`, `runtime_events`) over `read_parquet` of
the files it listed, applying the lake's rules (store/lake.py): the latest version of a request,
of a run, of a restart's flips; tombstones dropped; files covered by a merged file skipped.
Nothing is imported: DuckDB reads the files where they are.

Pruning: a lake `scoped` to some runs lists only their `run_id=` folders (a server session's
run, whose requests can sit in client runs' folders, lists the `date=` folders of its lifetime
in every run folder), so a report's cost follows the events of its runs, not the lake's size;
within the listed files DuckDB skips partitions by `run_id` (hive) and row groups by their
statistics (`ts`, `vllm_session`). Each view names its files, so DuckDB lists nothing again per
query. Every value in a view is a path this process listed, written as an escaped literal
(DuckDB takes no parameters in a view's table functions).
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import date, datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb

from servescope.store.db import Store, quiet
from servescope.store.lake import (
    LAKE_COLUMNS,
    NULL_PARTITION,
    SCHEMA,
    LakeFile,
    hived,
    list_files,
    run_folder,
    sql_literal,
)
from servescope.store.queries import ROUTED_SAMPLE, ROUTED_SAMPLE_ROWS

SESSION_PREFIX = "vllm-"  # a server session's run (collector/sessions.py)
COPY_ROWS = 2_000_000  # the most events a scoped read copies into memory (see `_views`)
_HIVE = "hive_partitioning = true, hive_types = {'run_id': 'VARCHAR', 'date': 'DATE'}"


class NoLake(ValueError):
    """A `--lake` folder (or glob) that holds no lake."""


class ReadOnlyLake(RuntimeError):
    """Something tried to write through a lake reader: sidecars write lakes (`collect --lake`)."""


def lake_roots(specs: Sequence[str | Path]) -> list[Path]:
    """The lake folders `--lake` names: folders, or globs of folders, each holding a lake
    (its `_schema/` folder, written by every sidecar when it starts)."""
    roots: list[Path] = []
    for spec in specs:
        text = str(spec)
        matches = sorted(glob.glob(text)) if glob.has_magic(text) else [text]
        found = [Path(m).resolve() for m in matches if (Path(m) / SCHEMA).is_dir()]
        if not found:
            raise NoLake(
                f"no lake at {text}: a lake is a folder that `servescope collect --lake` writes "
                f"(it holds {SCHEMA}/ and a folder per table)"
            )
        roots.extend(r for r in found if r not in roots)
    return roots


class Lake(Store):
    """Read-only store over one or more lake folders (see the module docstring)."""

    def __init__(self, roots: Sequence[str | Path], runs: Sequence[str] | None = None) -> None:
        self.roots = lake_roots(roots)
        self.scope = tuple(dict.fromkeys(runs)) if runs is not None else None
        self.path = Path(", ".join(str(r) for r in self.roots))  # for messages and titles
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
        """A run with rows in the lake (its folder has a file) or a `runs` row; read without
        reading any event."""
        folder = [run_folder(run_id)]
        for root in self.roots:
            for table in ("events", "runtime_events"):
                if list_files(root, table, folder):
                    return True
        with Lake(self.roots, runs=[]).read() as con:
            row = con.execute("SELECT count(*) FROM runs WHERE run_id = $1", [run_id]).fetchone()
        return bool(row and row[0])

    @contextmanager
    def read(self) -> Iterator[duckdb.DuckDBPyConnection]:
        con = quiet(duckdb.connect())
        con.execute("SET parquet_metadata_cache = true")  # each query would read the footers again
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
        self._view(con, "runs", _RUNS)
        self._view(con, "lever_flips", _FLIPS)
        folders = None if self.scope is None else [run_folder(r) for r in self.scope]
        self._view(con, "metric_samples", _PLAIN, folders)
        self._view(con, "runtime_events", _PLAIN, folders)
        sessions = [r for r in self.scope or () if r.startswith(SESSION_PREFIX)]
        if sessions:  # their requests sit in other runs' folders too: every run, their days
            spans = [_span(con, s) for s in sessions]
            dated = lambda d: any(_within(d, s) for s in spans)  # noqa: E731
            files = self._view(con, "events", None, None, dated)
        else:
            files = self._view(con, "events", None, folders)
        if self.scope is not None and _count(con, "SELECT count(*) FROM events") <= COPY_ROWS:
            self._copy_events(con, files, sessions)

    def _copy_events(
        self, con: duckdb.DuckDBPyConnection, files: list[LakeFile], sessions: list[str]
    ) -> None:
        """A report queries its runs' events some fifty times, and each query of a view opens
        every listed file again (a run served by 64 sidecars is 64 files or more): the runs'
        rows are read once into one in-memory table instead, when they fit (COPY_ROWS keeps a
        report under 1 GiB; larger runs are read through the views, slower, in bounded memory).

        Only what a report can read is held: not a column NULL in every file listed (a client
        run's server figures, its trace ids: the file's statistics say so, nothing is read),
        nor `doc`, the verbatim record, unless a server session's checks or a fleet run's
        replicas read it (reports.sql: _CHAT, ROUTED_SAMPLE, BY_REPLICA). `events` is then a
        view over the table giving those columns as NULLs, in the order of the store's. One run
        at a time, so each run's rows lie together and a query of one run skips the other's
        row groups (a session's requests of other runs come last)."""
        columns = [(name, kind) for name, kind, *_ in con.execute("DESCRIBE events").fetchall()]
        empty = _empty_columns(con, files, [name for name, _kind in columns])
        if not sessions and not any(_fleet(con, run) for run in self.scope or ()):
            empty.add("doc")
        held = ", ".join(f'"{name}"' for name, _kind in columns if name not in empty)
        con.execute("ALTER VIEW events RENAME TO events_in_files")
        con.execute(f"CREATE TABLE events_held AS SELECT {held} FROM events_in_files LIMIT 0")  # noqa: S608
        add = f"INSERT INTO events_held SELECT {held} FROM events_in_files"  # noqa: S608
        for run in self.scope or ():
            con.execute(add + " WHERE run_id = $1", [run])
        if sessions:
            con.execute(add + " WHERE NOT list_contains($1, run_id)", [list(self.scope or ())])
        view = ", ".join(
            f'CAST(NULL AS {kind}) AS "{name}"' if name in empty else f'"{name}"'
            for name, kind in columns
        )
        con.execute(f"CREATE VIEW events AS SELECT {view} FROM events_held")  # noqa: S608

    def _view(
        self,
        con: duckdb.DuckDBPyConnection,
        table: str,
        body: str | None,
        folders: list[str] | None = None,
        date_ok: Any = None,
    ) -> list[LakeFile]:
        """The view of one table over its listed files; returns them."""
        files = [f for root in self.roots for f in list_files(root, table, folders, date_ok)]
        schemas = [p for root in self.roots for p in sorted((root / SCHEMA / table).glob("*"))]
        union = len({p.name.split(".", 1)[1] for p in schemas}) > 1
        source = _source(files, schemas, union)
        if body is None:  # events
            body = _EVENTS if files and _has_updates(con, source) else _PLAIN
        con.execute(f"CREATE VIEW {table} AS " + body.replace("SOURCE", source))  # noqa: S608
        return files


def _source(files: Sequence[Any], schemas: list[Path], union: bool) -> str:
    """`read_parquet` of the files (hive-partitioned ones by their path, the others by their
    own `run_id`), or of the schema files when there is none: a table with no rows yet."""
    by_name = "union_by_name = " + ("true" if union else "false")
    parts = []
    hive = [f.path for f in files if hived(f.partition.parent.name.partition("=")[2])]
    plain = [f.path for f in files if f.path not in set(hive)]
    if hive:
        parts.append(_READ.replace("FILES", _list(hive)).replace("OPTIONS", f"{_HIVE}, {by_name}"))
    if plain:
        plain_options = f"hive_partitioning = false, {by_name}"  # the file's own run_id
        parts.append(_READ.replace("FILES", _list(plain)).replace("OPTIONS", plain_options))
    if not parts:
        if not schemas:
            raise NoLake("the lake has no schema files: was it written by `collect --lake`?")
        parts.append(
            _READ.replace("FILES", _list(schemas)).replace("OPTIONS", "union_by_name = true")
        )
    return "(" + " UNION ALL BY NAME ".join(parts) + ")"


_READ = "SELECT * FROM read_parquet(FILES, OPTIONS)"


def _list(paths: Sequence[Path]) -> str:
    return "[" + ", ".join(f"'{sql_literal(p)}'" for p in paths) + "]"


def _count(con: duckdb.DuckDBPyConnection, sql: str, params: Any = None) -> int:
    row = con.execute(sql, params).fetchone()
    return int(row[0]) if row else 0


def _empty_columns(
    con: duckdb.DuckDBPyConnection, files: Sequence[LakeFile], names: list[str]
) -> set[str]:
    """The columns (of `names`, top-level ones) that no listed file holds a value of, by the
    files' statistics (a writer that keeps no null counts: none is empty). `run_id` is never
    one: a hive reader takes it from the folder."""
    if not files:
        return set()
    rows = con.execute(
        "SELECT path_in_schema, bool_and(stats_null_count IS NOT NULL"
        " AND stats_null_count = num_values) FROM parquet_metadata($1) GROUP BY path_in_schema",
        [[str(f.path) for f in files]],
    ).fetchall()
    return {path for path, empty in rows if empty and path in names and path != "run_id"}


def _fleet(con: duckdb.DuckDBPyConnection, run_id: str) -> bool:
    """A fleet run, as reports.replicas tells one: its notes name replicas, or its first
    events carry routing decisions (read from the files)."""
    row = con.execute("SELECT notes FROM runs WHERE run_id = $1", [run_id]).fetchone()
    try:
        notes = json.loads(row[0]) if row and row[0] else {}
    except (TypeError, ValueError):
        notes = {}
    if isinstance(notes, dict) and notes.get("replicas"):
        return True
    params = {"run_id": run_id, "rows": ROUTED_SAMPLE_ROWS}
    return bool(_count(con, ROUTED_SAMPLE, params))  # `events` still the files' view


def _has_updates(con: duckdb.DuckDBPyConnection, source: str) -> bool:
    """Whether any listed request has more than one version (few do: only those whose pieces
    reached the store in several flushes)."""
    row = con.execute(f"SELECT bool_or(lake_update) FROM {source}").fetchone()  # noqa: S608
    return bool(row and row[0])


_HIDDEN = ", ".join(("date", *LAKE_COLUMNS))
_PLAIN = "SELECT * EXCLUDE (HIDDEN) FROM SOURCE".replace("HIDDEN", _HIDDEN)
# Per request the latest version, unless it is a tombstone; only requests with an update
# are grouped (the join's other side is empty for a run without any).
_EVENTS = """
SELECT s.* EXCLUDE (HIDDEN)
FROM SOURCE s
LEFT JOIN (SELECT run_id, request_id, max(lake_version) AS latest
           FROM SOURCE WHERE lake_update GROUP BY run_id, request_id) u
    ON s.run_id = u.run_id AND s.request_id = u.request_id
WHERE (u.latest IS NULL OR s.lake_version = u.latest) AND NOT s.lake_deleted
""".replace("HIDDEN", _HIDDEN)
# A restart's flips are the set its latest version wrote (a NULL lever: the set is empty).
_FLIPS = """
SELECT * EXCLUDE (HIDDEN, latest) FROM (
    SELECT *, max(lake_version) OVER (PARTITION BY run_id, before_run_id) AS latest
    FROM SOURCE
) WHERE lever IS NOT NULL AND (before_run_id IS NULL OR lake_version = latest)
""".replace("HIDDEN", _HIDDEN)


# A run is its latest `runs` row.
_RUNS = """
SELECT * EXCLUDE (HIDDEN) FROM SOURCE
QUALIFY row_number() OVER (PARTITION BY run_id ORDER BY lake_version DESC) = 1
""".replace("HIDDEN", _HIDDEN)


def _span(con: duckdb.DuckDBPyConnection, run_id: str) -> tuple[date | None, date | None]:
    """The days a session's requests can be dated (its `runs` row's lifetime, a day either
    side for clocks and midnight); (None, None) when the lake does not say."""
    row = con.execute("SELECT started_at, ended_at FROM runs WHERE run_id = $1", [run_id])
    found = row.fetchone()
    if not found:
        return None, None
    started, ended = found
    lo = started.date() - timedelta(days=1) if isinstance(started, datetime) else None
    hi = ended.date() + timedelta(days=1) if isinstance(ended, datetime) else None
    return lo, hi


def _within(folder_date: str, span: tuple[date | None, date | None]) -> bool:
    if folder_date == NULL_PARTITION:
        return True
    try:
        day = date.fromisoformat(folder_date)
    except ValueError:
        return True
    lo, hi = span
    return (lo is None or day >= lo) and (hi is None or day <= hi)
