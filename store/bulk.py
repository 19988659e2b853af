"""Bulk ingestion of `.events.jsonl` lines: DuckDB parses, checks and inserts, Python judges the
rest.

Decoding a million lines in Python costs seconds before the database sees one; DuckDB's readers
split and parse them in parallel in native code. A chunk of complete lines is written to a
temporary file and inserted by one SQL statement (`queries.BULK_INSERT`) that parses each line
once and checks it with conditions deliberately stricter than `store.events.check`, so a line
it takes is one `check` accepts too. It takes a line when its request is not stored yet;
requests seen on several lines of the chunk are removed again. Every other line (bad JSON, wrong
types, a runtime event, a request seen twice or already stored) goes through the ordinary path:
`parse_line` decides (and names the reason when it refuses) and `Store.add_events` merges. The
result is the same as feeding every line to `parse_line` and `add_events`, only faster; the
common case (every line new and well-formed) costs one statement and no work in Python.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import duckdb

from store import queries
from store.events import CONTRACT_TYPES, STATUSES, InvalidEvent, parse_line, run_id_of

if TYPE_CHECKING:
    from store.db import Store

PREFIX = "servescope-bulk-"
MAX_RAW = 64 * 1024  # bytes of a quarantined line kept in ingest_errors.raw
MAX_CSV_LINE = 4 * 1024 * 1024  # longest line given to the CSV reader (its buffers scale with it)
_NUMBER = r"-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?"
_EXTRA_KEYS = (
    "type", "server_ts", "log_ts", "server_outcome", "server_ttft_ms", "server_e2e_ms",
    "vllm_session",
)  # fmt: skip
_CSV_UNSAFE = (b"\r", b"\x1f")  # a line end to the CSV reader; its delimiter


@dataclass
class BulkResult:
    """What a chunk gave: its lines, requests written, and the lines refused as (offset,
    reason)."""

    lines: int = 0
    events: int = 0
    errors: list[tuple[int, str]] = field(default_factory=list)
    keys: list[tuple[str, str]] = field(default_factory=list)


def _fast_conditions() -> str:
    """SQL over the line's top-level values (raw JSON, NULL when absent or null) that implies
    `check(doc)` passes. A JSON value's text tells its type: a string starts with a quote, an
    integer reads back as the same digits, true/false are themselves."""
    rid = "request_id::VARCHAR"
    conds = [  # printable ASCII without escapes: the run-id rule reads the same in SQL and Python
        f"starts_with({rid}, '\"') AND strlen({rid}) > 2 AND NOT contains({rid}, '\\')"
        f" AND strlen({rid}) = length({rid})",
        "(type IS NULL OR type::VARCHAR = '\"request\"')",
    ]
    for key, types in CONTRACT_TYPES.items():
        if key == "request_id":
            continue
        frag = f"{key}::VARCHAR"
        if key == "status":
            allowed = ", ".join(f"'\"{s}\"'" for s in sorted(STATUSES))
            test = f"{frag} IN ({allowed})"
        elif types == (str,):
            test = f"starts_with({frag}, '\"')"
        elif types == (int,):
            test = f"TRY_CAST({frag} AS BIGINT)::VARCHAR = {frag}"
        elif types == (bool,):
            test = f"{frag} IN ('true', 'false')"
        elif types == (list,):
            item = rf"\s*{_NUMBER}\s*"
            test = rf"regexp_full_match({frag}, '\[({item}(,{item})*|\s*)\]')"
        else:  # numbers
            test = f"TRY_CAST({frag} AS DOUBLE) IS NOT NULL"
        conds.append(f"({key} IS NULL OR {test})")
    return "\n      AND ".join(conds)


_SHAPE = json.dumps({key: "JSON" for key in [*CONTRACT_TYPES, *_EXTRA_KEYS]})
_INSERT = {
    lines: queries.BULK_INSERT.format(lines=lines, ok=_fast_conditions())
    for lines in (queries.BULK_LINES_CSV, queries.BULK_LINES_TEXT)
}


def ingest_lines(
    store: Store,
    con: duckdb.DuckDBPyConnection,
    data: bytes | list[bytes],
    *,
    source: str,
    offset: int,
    want_keys: bool = False,
) -> BulkResult:
    """Ingest `data` (complete `\\n`-terminated lines starting at byte `offset` of `source`; or
    consecutive pieces of it, which spares joining them) in the caller's transaction. Refused
    lines go to `ingest_errors` with their offsets."""
    result = BulkResult()
    pieces = [p for p in ([data] if isinstance(data, bytes) else data) if p]
    if not pieces:
        return result
    if not pieces[-1].endswith(b"\n"):
        pieces.append(b"\n")
    result.lines = sum(p.count(b"\n") for p in pieces)
    if not all(_utf8(p) for p in pieces):  # pieces end on line ends: none splits a character
        _python_path(store, con, _split(b"".join(pieces), offset), source, result)
        return result
    csv = not any(b in p for p in pieces for b in _CSV_UNSAFE) and not any(
        _has_long_line(p, MAX_CSV_LINE) for p in pieces
    )
    lines = queries.BULK_LINES_CSV if csv else queries.BULK_LINES_TEXT
    params: dict[str, Any] = {"max_line": MAX_CSV_LINE} if csv else {}
    fd, path = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", suffix=".jsonl", dir=_tmp_dir())
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.writelines(pieces)
        params["path"] = path
        row = con.execute(queries.BULK_LAST_ROWID).fetchone()
        after = int(row[0]) if row else -1
        row = con.execute(_INSERT[lines], {**params, "shape": _SHAPE}).fetchone()
        inserted = int(row[0]) if row else 0
        if inserted:
            row = con.execute(queries.BULK_DROP_REPEATED, {"after": after}).fetchone()
            inserted -= int(row[0]) if row else 0
        if want_keys and inserted:
            keys = con.execute(queries.BULK_NEW_KEYS, {"after": after}).fetchall()
            result.keys = [(run_id, request_id) for run_id, request_id in keys]
        rest: set[bytes] = set()
        if inserted < result.lines:
            query = queries.BULK_REST.format(lines=lines)
            rows = con.execute(query, {**params, "after": after}).fetchall()
            rest = {line.encode() for (line,) in rows}
    finally:
        os.unlink(path)
    result.events += inserted
    if rest:
        found = [x for x in _split(b"".join(pieces), offset) if x[1] in rest]
        _python_path(store, con, found, source, result)
    return result


def remove_stale_chunks() -> None:
    """Delete chunk files left by a process that was killed inside a flush."""
    folder = _tmp_dir() or tempfile.gettempdir()
    for name in os.listdir(folder):
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _tmp_dir() -> str | None:
    """RAM-backed when the machine has one: the chunk is read back at once and then deleted."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _utf8(data: bytes) -> bool:
    if data.isascii():  # the common case, without decoding a copy
        return True
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _has_long_line(data: bytes, limit: int) -> bool:
    """Whether `data` may hold a line longer than `limit` (every stretch of limit/2 bytes
    holding a newline proves it does not)."""
    half = limit // 2
    return len(data) > half and any(
        data.find(b"\n", i, i + half) < 0 for i in range(0, len(data) - half, half)
    )


def _split(data: bytes, offset: int) -> list[tuple[int, bytes]]:
    lines = []
    for line in data.split(b"\n"):
        if line.strip():
            lines.append((offset, line))
        offset += len(line) + 1
    return lines


def _python_path(
    store: Store,
    con: duckdb.DuckDBPyConnection,
    lines: list[tuple[int, bytes]],
    source: str,
    result: BulkResult,
) -> None:
    docs: list[dict[str, Any]] = []
    errors: list[tuple[int, str, bytes]] = []
    for off, line in lines:
        if not line.strip():
            continue
        try:
            docs.append(parse_line(line))
        except InvalidEvent as exc:
            errors.append((off, str(exc), line))
    if docs:
        result.events += store.add_events(docs, con)
        result.keys.extend((run_id_of(d), d["request_id"]) for d in docs if "request_id" in d)
    for off, reason, line in errors:
        store.add_ingest_error(source, off, reason, clip(line), con)
        result.errors.append((off, reason))


def clip(raw: bytes) -> bytes:
    """A quarantined line as kept: whole up to MAX_RAW bytes, else its head and its length."""
    if len(raw) <= MAX_RAW:
        return raw.rstrip(b"\r\n")
    return raw[:MAX_RAW] + f"… [{len(raw)} bytes, cut]".encode()
