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
    hived,
    list_files,
    run_folder,
    sql_literal,
)

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
            self._view(con, "events", None, None, lambda d: any(_within(d, s) for s in spans))
        else:
            self._view(con, "events", None, folders)
        if self.scope is not None and _count(con, "SELECT count(*) FROM events") <= COPY_ROWS:
            # a report queries its runs' events some fifty times, and each query of a view
            # opens every listed file again (a run served by 64 sidecars is 64 files or more):
            # the runs' rows are read once into one in-memory table instead, when they fit
            # (~350 bytes a row: COPY_ROWS keeps a report under 1 GiB; larger runs are read
            # through the views, slower, in bounded memory). `doc`, the verbatim record, only a
            # server session's report reads (reports.sql.SLICE_CHECKS).
            # One run at a time, so each run's rows lie together and a query of one run skips
            # the other's row groups (a session's requests of other runs come last).
            doc = "doc AS doc" if sessions else "CAST(NULL AS VARCHAR) AS doc"
            con.execute("ALTER VIEW events RENAME TO events_in_files")
            con.execute(_COPY_EVENTS.replace("DOC", doc) + " LIMIT 0")
            for run in self.scope:
                con.execute(_ADD_EVENTS.replace("DOC", doc) + " WHERE run_id = $1", [run])
            if sessions:
                others = " WHERE NOT list_contains($1, run_id)"
                con.execute(_ADD_EVENTS.replace("DOC", doc) + others, [list(self.scope)])


    def _view(
        self,
        con: duckdb.DuckDBPyConnection,
        table: str,
        body: str | None,
        folders: list[str] | None = None,
        date_ok: Any = None,
    ) -> None:
        files = [f for root in self.roots for f in list_files(root, table, folders, date_ok)]
        schemas = [p for root in self.roots for p in sorted((root / SCHEMA / table).glob("*"))]
        union = len({p.name.split(".", 1)[1] for p in schemas}) > 1
        source = _source(files, schemas, union)
        if body is None:  # events
            body = _EVENTS if files and _has_updates(con, source) else _PLAIN
        con.execute(f"CREATE VIEW {table} AS " + body.replace("SOURCE", source))  # noqa: S608


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


def _count(con: duckdb.DuckDBPyConnection, sql: str) -> int:
    row = con.execute(sql).fetchone()
    return int(row[0]) if row else 0


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
_COPY_EVENTS = "CREATE TABLE events AS SELECT * REPLACE (DOC) FROM events_in_files"
_ADD_EVENTS = "INSERT INTO events SELECT * REPLACE (DOC) FROM events_in_files"
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
