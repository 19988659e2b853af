"""The DuckDB event store: short transactions on one file, so readers and writers take turns.

DuckDB lets one process at a time hold a database file open for writing, and a reader in another
process cannot open the file while a writer holds it. The store therefore never keeps a connection
open between operations: every write is one short transaction that closes the file when it
commits, and every read opens the file, queries, and closes it. A process that finds the file
busy retries until `lock_timeout_s`; the wait is at most one writer's transaction.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb

from servescope.store import queries, runtime
from servescope.store.validation import clip, dumps, load_doc, run_id_of

DEFAULT_PATH = Path("servescope-data") / "servescope.duckdb"


def quiet(con: duckdb.DuckDBPyConnection) -> duckdb.DuckDBPyConnection:
    """`con` without DuckDB's own progress bar, which it prints to stdout once a query runs past
    2 s: into the JSON a script reads from `--json`. Commands draw their own (rich, on stderr)."""
    con.execute("SET enable_progress_bar = false")
    return con


def default_path() -> Path:
    """`$SERVESCOPE_STORE`, else `./servescope-data/servescope.duckdb`."""
    return Path(os.environ.get("SERVESCOPE_STORE") or DEFAULT_PATH)


def _ddl() -> list[str]:
    # Imported here, not at the top: the ORM takes a third of a second to import and only
    # schema creation needs it (readers such as `report build` never do).
    from duckdb_engine import Dialect
    from sqlalchemy.schema import CreateTable
    from sqlmodel import SQLModel

    from servescope.store.schema import TABLES

    dialect = Dialect()
    statements = []
    for model in TABLES:
        table = SQLModel.metadata.tables[model.__tablename__]  # type: ignore[attr-defined]
        ddl = str(CreateTable(table, if_not_exists=True).compile(dialect=dialect))
        statements.append(ddl.strip())
    return statements


# Kept from the record first seen: where the request was first seen from, and the model name the
# client asked for (a server log names the same model by its served name).
FIRST_WINS = frozenset({"source", "model"})

# One request can be served in parts: a call with `n` > 1 by one child request per sample, a
# completions call with a list of prompts by one per prompt (and per sample of each). vLLM traces
# every part with its own `llm_request` span; a span's piece names its part in `vllm_part`:
# `<prompt>#<sample>` (the collector writes `<vLLM id of the prompt>#<span id>`), the parts
# sharing a `<prompt>` being samples of one prompt.
PART_KEY = "vllm_part"
PARTS = "parts"
# What a part's span says about that part alone: kept per part under `parts`, and summed up
# for the request (`_sum_parts`).
PART_FIELDS = (
    "server_ts",
    "trace_id",
    "queue_ms",
    "prefill_ms",
    "decode_ms",
    "inference_ms",
    "server_ttft_ms",
    "server_e2e_ms",
    "prompt_tokens",
    "completion_tokens",
)


def merge_docs(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """Field-by-field merge of two records of one request, whatever order they arrive in.

    A later piece fills and updates fields but never erases one with a null, and the record
    keeps the `source` it was first seen from.

    A request served in several parts (pieces with different `vllm_part`s: the samples of an
    `n` > 1 call, the prompts of a completions call with a list of prompts) keeps each part's
    own figures in `parts` (keyed by part) and the request's figures summed up from them
    (`_sum_parts`), so the merge stays idempotent and order-free with parts too: the same piece
    twice, or a stored row merged again with new pieces, gives the same row. A request with
    one part is stored flat, as it always was.
    """
    if _parted(old) or _parted(new) or _two_parts(old, new):
        return _merge_parts(old, new)
    return _merge_fields(old, new)


def _merge_fields(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    merged = dict(old)
    for key, value in new.items():
        if value is None and merged.get(key) is not None:
            continue
        if key in FIRST_WINS and merged.get(key) is not None:
            continue
        merged[key] = value
    return merged


def _part_id(doc: dict[str, Any]) -> str | None:
    part = doc.get(PART_KEY)
    return part if isinstance(part, str) and part and _summable(doc) else None


def _summable(fields: dict[str, Any]) -> bool:
    """The part figures of a record have the types `_sum_parts` adds and compares (a record
    from outside may hold anything under these names; it is then merged as any record)."""
    for key in PART_FIELDS:
        value = fields.get(key)
        if value is None:
            continue
        if key in ("server_ts", "trace_id"):
            ok = isinstance(value, str)
        elif key.endswith("_tokens"):
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        else:
            ok = (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and math.isfinite(value)
                and value >= 0
            )
        if not ok:
            return False
    return True


def _parted(doc: dict[str, Any]) -> bool:
    """A row merged from several parts (as `_merge_parts` writes it, not any `parts` key a
    record from outside may hold: that one is kept verbatim like every unknown key)."""
    parts = doc.get(PARTS)
    return (
        isinstance(parts, dict)
        and len(parts) > 1
        and all(
            isinstance(p, dict) and p.get(PART_KEY) == k and _summable(p) for k, p in parts.items()
        )
    )


def _two_parts(old: dict[str, Any], new: dict[str, Any]) -> bool:
    a, b = _part_id(old), _part_id(new)
    return a is not None and b is not None and a != b


def _split(doc: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """A record as (what it says of the whole request, its parts by part key)."""
    if _parted(doc):  # its figures were summed from its parts, or said by a whole-request record
        base = {k: v for k, v in doc.items() if k != PARTS}
        return base, {k: dict(p) for k, p in doc[PARTS].items()}
    part = _part_id(doc)
    if part is None:  # a client's, a log's record: about the whole request
        return dict(doc), {}
    fields = {k: doc[k] for k in (PART_KEY, *PART_FIELDS) if doc.get(k) is not None}
    base = {k: v for k, v in doc.items() if k != PART_KEY and k not in PART_FIELDS}
    return base, {part: fields}


def _merge_parts(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    old_base, old_parts = _split(old)
    new_base, new_parts = _split(new)
    base = _merge_fields(old_base, new_base)
    parts = {
        key: _merge_fields(old_parts.get(key, {}), new_parts.get(key, {}))
        for key in sorted({*old_parts, *new_parts})
    }
    summed = _sum_parts(parts)
    said_n = base.get("n")  # a log line's `n` (the request's), or what a stored row said
    if isinstance(said_n, int) and not isinstance(said_n, bool):
        summed["n"] = max(summed["n"], said_n)
    return {**base, **summed, PARTS: parts}


def _sum_parts(parts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The request's figures from its parts, as the API's `usage` and a client see them (each
    replaces what a single part or a whole-request record said; a figure no part has is kept).

    - `completion_tokens`: the sum over parts (usage counts every sample's tokens);
    - `prompt_tokens`: once per prompt (the part key's `<prompt>`), summed over prompts: the
      samples of one prompt share it, and usage counts it once per prompt;
    - `server_ttft_ms`, `queue_ms`, `server_ts`: the earliest part's (the client's first token
      is the first any part produced; the request waited until its first part ran);
      `prefill_ms` that first part's; `server_e2e_ms`, `decode_ms`, `inference_ms`: the
      longest part's (the response ends with its last part);
    - `server_tpot_ms`: the mean of the parts' own (vLLM's TPOT is a sample's: decode time over
      its tokens after the first; the summed tokens over the longest decode would halve it);
    - `n`: samples per prompt (a child's span says 1), or the `n` a log line gave, the larger;
    - `vllm_request_id` the first prompt's, `trace_id` the first part's, in part-key order (one
      value whatever order the parts came in).
    """
    keys = sorted(parts)
    values = [parts[k] for k in keys]
    out: dict[str, Any] = {}

    def present(key: str) -> list[Any]:
        return [p[key] for p in values if p.get(key) is not None]

    if tokens := present("completion_tokens"):
        out["completion_tokens"] = sum(tokens)
    prompts: dict[str, int] = {}
    samples: dict[str, int] = {}
    for key, p in zip(keys, values, strict=True):
        prompt = key.rpartition("#")[0] or key
        samples[prompt] = samples.get(prompt, 0) + 1
        if p.get("prompt_tokens") is not None:
            prompts[prompt] = max(prompts.get(prompt, 0), p["prompt_tokens"])
    if prompts:
        out["prompt_tokens"] = sum(prompts.values())
    for key in ("server_ts", "queue_ms", "server_ttft_ms"):
        if found := present(key):
            out[key] = min(found)
    first = min(
        (k for k, p in zip(keys, values, strict=True) if p.get("server_ttft_ms") is not None),
        key=lambda k: (parts[k]["server_ttft_ms"], k),
        default=None,
    )
    if first is not None and parts[first].get("prefill_ms") is not None:
        out["prefill_ms"] = parts[first]["prefill_ms"]
    for key in ("server_e2e_ms", "decode_ms", "inference_ms"):
        if found := present(key):
            out[key] = max(found)
    tpots = [
        p["decode_ms"] / (p["completion_tokens"] - 1)
        for p in values
        if p.get("decode_ms") is not None and (p.get("completion_tokens") or 0) > 1
    ]
    if tpots:
        out["server_tpot_ms"] = sum(tpots) / len(tpots)
    out["n"] = max(samples.values())
    out["vllm_request_id"] = min(samples)
    if found := present("trace_id"):
        out["trace_id"] = found[0]
    return out


class StoreBusy(RuntimeError):
    """The file stayed locked by another process for longer than the store waits."""


class Store:
    """The servescope store in one DuckDB file."""

    def __init__(self, path: str | Path | None = None, *, lock_timeout_s: float = 30.0) -> None:
        self.path = Path(path) if path is not None else default_path()
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
        if self._initialised:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        con = self._connect(read_only=False)
        try:
            con.begin()
            for statement in _ddl():
                con.execute(statement)
            self._add_columns(con)
            keyed = con.execute(queries.EVENTS_KEY_INDEX).fetchone()
            if keyed and keyed[0]:  # a store made before `events` lost its key index
                con.execute(queries.UNKEY_EVENTS_RENAME)
                for statement in _ddl():  # creates `events` again, unkeyed
                    con.execute(statement)
                con.execute(queries.UNKEY_EVENTS_COPY)
            con.commit()
        finally:
            con.close()
        self._initialised = True

    @staticmethod
    def _missing_columns(con: duckdb.DuckDBPyConnection) -> list[tuple[str, str]]:
        added = queries.ADDED_COLUMNS
        params = {"tables": [a[0] for a in added], "columns": [a[1] for a in added]}
        return [tuple(row) for row in con.execute(queries.MISSING_COLUMNS, params).fetchall()]

    def _add_columns(self, con: duckdb.DuckDBPyConnection) -> None:
        """Columns newer than the store: added, and filled from the rows' documents."""
        missing = set(self._missing_columns(con))
        for table, column, kind, fill in queries.ADDED_COLUMNS:
            if (table, column) not in missing:
                continue
            con.execute(f'ALTER TABLE {table} ADD COLUMN "{column}" {kind}')
            if fill:
                con.execute(f'UPDATE {table} SET "{column}" = {fill}')  # noqa: S608 - constants

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
    def read(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A read-only view of everything committed so far."""
        if not self.path.exists():
            self._ensure_schema()
        con = self._connect(read_only=True)
        if not self._initialised and self._missing_columns(con):  # a store of an older version
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
        docs: Iterable[dict[str, Any]],
        con: duckdb.DuckDBPyConnection | None = None,
        *,
        cursor: runtime.RuntimeCursor | None = None,
    ) -> int:
        """Insert or merge validated records; returns how many distinct rows they touched.

        Records of the same request (same run and request_id) become one row, merged with
        `merge_docs`, so ingesting the same record twice changes nothing. Agent-runtime lines
        (`store.validation.is_runtime_event`) go to `runtime_events`; pass the same `cursor` for
        every batch of one file so each keeps its place among the requests.
        """
        requests, runtime_rows = runtime.split(docs, cursor or runtime.RuntimeCursor())
        batch: dict[tuple[str, str], dict[str, Any]] = {}
        for doc in requests:
            key = (run_id_of(doc), doc["request_id"])
            batch[key] = merge_docs(batch[key], doc) if key in batch else doc
        if not batch and not runtime_rows:
            return 0
        if con is None:
            with self.write() as tx:
                return self._add_events(tx, batch) + runtime.insert(tx, runtime_rows)
        return self._add_events(con, batch) + runtime.insert(con, runtime_rows)

    def _add_events(
        self, con: duckdb.DuckDBPyConnection, batch: dict[tuple[str, str], dict[str, Any]]
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
                batch[key] = merge_docs(load_doc(doc), batch[key])
            con.execute(queries.STAGE_EVENTS)
            self._fill_stage(con, keys, [dumps(batch[k]) for k in keys])
            con.execute(queries.DELETE_STAGED_EVENTS)  # replaced by their merged rows
        con.execute(queries.INSERT_STAGED_EVENTS)
        con.execute(queries.DROP_STAGE)
        return len(keys)

    @staticmethod
    def _fill_stage(
        con: duckdb.DuckDBPyConnection, keys: Sequence[tuple[str, str]], docs: list[str]
    ) -> None:
        con.execute(queries.FILL_STAGE, [[k[0] for k in keys], [k[1] for k in keys], docs])

    def upsert_run(
        self, run_id: str, con: duckdb.DuckDBPyConnection | None = None, **fields: Any
    ) -> None:
        """Create or update a `runs` row; fields left out (or None) keep their stored value."""
        params: dict[str, Any] = {
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
        if con is None:
            with self.write() as tx:
                tx.execute(queries.UPSERT_RUN, params)
        else:
            con.execute(queries.UPSERT_RUN, params)

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
        # one columnar statement: executemany costs ~2 ms a row, a /metrics page has ~400
        columns = [list(column) for column in zip(*rows, strict=True)]
        if con is None:
            with self.write() as tx:
                tx.execute(queries.INSERT_METRIC_SAMPLES, columns)
        else:
            con.execute(queries.INSERT_METRIC_SAMPLES, columns)

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
        now = datetime.now(UTC).replace(tzinfo=None)
        row = (ts or now, lever, run_id, before, after, note, before_run_id)
        if con is None:
            with self.write() as tx:
                tx.execute(queries.INSERT_LEVER_FLIP, row)
        else:
            con.execute(queries.INSERT_LEVER_FLIP, row)

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
        row = (source, offset, datetime.now(UTC).replace(tzinfo=None), reason, raw)
        if con is None:
            with self.write() as tx:
                tx.execute(queries.INSERT_INGEST_ERROR, row)
        else:
            con.execute(queries.INSERT_INGEST_ERROR, row)

    # -- reads -------------------------------------------------------------------------------

    def runs(self) -> list[dict[str, Any]]:
        """Every run with its event counts (all, ok, errors, rejected) and flips, oldest first."""
        with self.read() as con:
            return _rows(con.execute(queries.LIST_RUNS))

    def run_ids(self) -> list[str]:
        return [r["run_id"] for r in self.runs()]

    def has_run(self, run_id: str) -> bool:
        with self.read() as con:
            row = con.execute(queries.RUN_EXISTS, {"run_id": run_id}).fetchone()
            return bool(row and row[0]) or runtime.has_run(con, run_id)

    def run(self, run_id: str) -> dict[str, Any] | None:
        with self.read() as con:
            rows = _rows(con.execute(queries.GET_RUN, [run_id]))
        return rows[0] if rows else None

    def counter_deltas(self, run_id: str, names: Sequence[str]) -> dict[str, float | None]:
        """How much each counter grew during the run (summed over series; resets handled).

        None for a counter the run's samples cannot measure (queries._STEP): not zero.
        """
        params = {"run_id": run_id, "names": list(names), "since": None, "until": None}
        with self.read() as con:
            rows = con.execute(queries.SLICE_COUNTER_DELTAS, params).fetchall()
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

    def export_lines(self, run_id: str) -> list[dict[str, Any]]:
        """The run's request records and agent-runtime events, in the order of their file."""
        with self.read() as con:
            return runtime.export_lines(con, run_id)

    def runtime_events(self, run_id: str) -> list[dict[str, Any]]:
        """The run's agent-runtime events joined to their request (by request_id or trace_id):
        [{"event": doc, "request": doc or None}] in ingestion order."""
        with self.read() as con:
            return runtime.joined(con, run_id)

    def export_events(self, run_id: str) -> list[dict[str, Any]]:
        """The run's records exactly as they were ingested (merged per request)."""
        with self.read() as con:
            rows = con.execute(queries.EXPORT_EVENTS, [run_id]).fetchall()
        return [load_doc(doc) for (doc,) in rows]


def _rows(cursor: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    names = [d[0] for d in cursor.description]
    out = []
    for values in cursor.fetchall():
        row = dict(zip(names, values, strict=True))
        for key in ("levers", "workload", "notes"):
            if isinstance(row.get(key), str):
                row[key] = json.loads(row[key])
        out.append(row)
    return out
