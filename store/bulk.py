"""Bulk ingestion of `.events.jsonl` lines: DuckDB parses, checks and inserts, Python judges the
rest.

Decoding a million lines in Python costs seconds before the database sees one; DuckDB's JSON
reader does it in parallel in native code. A chunk of complete lines is written to a temporary
file and split, parsed (once per line) and checked by SQL. The SQL checks are deliberately
stricter than `store.events.check`, so a line they accept is one `check` accepts too, and it
is a plain insert when its request appears once in the chunk and is not stored yet. Every other
line (bad JSON, wrong types, a runtime event, a request seen twice or already stored) goes
through the ordinary path: `parse_line` decides (and names the reason when it refuses) and
`Store.add_events` merges. The result is the same as feeding every line to `parse_line` and
`add_events`, only faster.
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
_NUMBER = r"-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?"
_EXTRA_KEYS = ("type", "server_ts", "log_ts", "server_outcome")


@dataclass
class BulkResult:
    """What a chunk gave: requests written, and the lines refused as (offset, reason)."""

    events: int = 0
    errors: list[tuple[int, str]] = field(default_factory=list)
    keys: list[tuple[str, str]] = field(default_factory=list)


def _is_null(frag: str) -> str:
    return f"({frag} IS NULL OR {frag} = 'null')"


def _fast_conditions() -> str:
    """SQL over `s` (the line's top-level fragments) that implies `check(doc)` passes."""
    ident = r"""regexp_full_match({f}, '"[ !#-\[\]-~]+"')"""
    conds = [
        "s IS NOT NULL",
        ident.format(f="s.request_id"),
        f"({_is_null('s.run_id')} OR {ident.format(f='s.run_id')})",
        f"({_is_null('s.type')} OR s.type = '\"request\"')",
    ]
    for key, types in CONTRACT_TYPES.items():
        if key in ("request_id", "run_id"):
            continue
        frag = f"s.{key}"
        if key == "status":
            allowed = ", ".join(f"'\"{s}\"'" for s in sorted(STATUSES))
            test = f"{frag} IN ({allowed})"
        elif types == (str,):
            test = f"starts_with({frag}, '\"')"
        elif types == (int,):
            test = f"regexp_full_match({frag}, '-?[0-9]+')"
        elif types == (bool,):
            test = f"{frag} IN ('true', 'false')"
        elif types == (list,):
            item = rf"\s*{_NUMBER}\s*"
            test = rf"regexp_full_match({frag}, '\[({item}(,{item})*|\s*)\]')"
        else:  # numbers
            test = f"regexp_full_match({frag}, '{_NUMBER}')"
        conds.append(f"({_is_null(frag)} OR {test})")
    return "\n      AND ".join(conds)


def _shape(kind: str) -> str:
    keys = [*CONTRACT_TYPES, *_EXTRA_KEYS]
    return json.dumps({k: ("JSON" if kind == "JSON" or k == "itl_ms" else kind) for k in keys})


_PARSE_SHAPE = _shape("JSON")
_VALUE_SHAPE = _shape("VARCHAR")
_SELECT_FAST = queries.BULK_SELECT_FAST.format(ok=_fast_conditions())


def ingest_lines(
    store: Store,
    con: duckdb.DuckDBPyConnection,
    data: bytes,
    *,
    source: str,
    offset: int,
    want_keys: bool = False,
) -> BulkResult:
    """Ingest `data` (complete `\\n`-terminated lines starting at byte `offset` of `source`) in
    the caller's transaction. Refused lines go to `ingest_errors` with their offsets."""
    result = BulkResult()
    if not data:
        return result
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        _python_path(store, con, _split(data, offset), source, result)
        return result
    fd, path = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", suffix=".jsonl", dir=_tmp_dir())
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data if data.endswith(b"\n") else data + b"\n")
        con.execute(queries.BULK_SPLIT, {"path": path, "base": offset})
        con.execute(queries.BULK_PARSE, {"shape": _PARSE_SHAPE})
        con.execute(_SELECT_FAST)
        row = con.execute(queries.BULK_COUNT_FAST).fetchone()
        fast = int(row[0]) if row else 0
        if fast:
            con.execute(queries.BULK_INSERT_EVENTS, {"shape": _VALUE_SHAPE})
            if want_keys:
                result.keys = [tuple(k) for k in con.execute(queries.BULK_FAST_KEYS).fetchall()]
        result.events += fast
        rest = [(int(o), line.encode()) for o, line in con.execute(queries.BULK_REST).fetchall()]
        con.execute(queries.BULK_DROP)
    finally:
        os.unlink(path)
    _python_path(store, con, rest, source, result)
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
