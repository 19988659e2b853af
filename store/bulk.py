"""Bulk ingestion of `.events.jsonl` lines: DuckDB parses, checks and inserts, Python judges the
rest.

Decoding a million lines in Python costs seconds before the database sees one; DuckDB's readers
split and parse them in parallel in native code. A chunk of complete lines is written to a
temporary file and inserted by one SQL statement (`queries.bulk_insert`) that parses each line
once and checks it with conditions deliberately stricter than `store.validation.check`, so a line
it takes is one `parse_line` accepts too. DuckDB's JSON reader is more lenient than JSON
(NaN/Infinity in any case, trailing commas, any depth), so a pre-screen (`_screen`: msgspec's
strict validation of the whole chunk at C speed, plus UTF-8) keeps the lines that are not
strict JSON out of the statement. The statement takes a line when its request is not stored
yet; requests seen on several lines of the chunk are removed again. Every other line (bad JSON,
wrong types, a runtime event, a request seen twice or already stored) goes through the
ordinary path: `parse_line` decides (and names the reason when it refuses) and
`Store.add_events` merges. The result is the same as feeding every line to `parse_line` and
`add_events`, only faster; the common case (every line new and well-formed) costs one
statement and one pass of the screen, and no work per line in Python.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import duckdb
import msgspec
import numpy as np
from typing_extensions import TypeIs

from servescope.store import queries, schema_sql
from servescope.store.validation import (
    CONTRACT_TYPES,
    COUNTS,
    DURATIONS,
    HTTP_STATUS,
    MAX_DEPTH,
    STATUSES,
    EventDoc,
    InvalidEvent,
    Record,
    is_runtime_event,
    parse_line,
    run_id_of,
)
from servescope.store.validation import (
    clip as clip,
)  # the collector's quarantine path keeps lines so too

if TYPE_CHECKING:
    from servescope.store.db import Store

PREFIX = "servescope-bulk-"
RAM_DIR = "/dev/shm"
MAX_CSV_LINE = 4 * 1024 * 1024  # longest line given to the CSV reader (its buffers scale with it)
_DURATION = r"[0-9]{1,20}(\.[0-9]+)?([eE][-+]?[0-9]{1,2})?"  # finite, >= 0: no sign, small exponent
# read by the statement beyond the contract; any JSON value (`error_detail` is kept as text)
_EXTRA_KEYS = ("type", "server_ts", "log_ts", "server_outcome", "error_detail")
_CSV_UNSAFE = (b"\r", b"\x1f")  # a line end to the CSV reader; its delimiter


class _Object(msgspec.Struct, gc=False):
    """A JSON object, its values validated and skipped: the cheapest strict parse msgspec has."""


_OBJECTS = msgspec.json.Decoder(_Object)
_RAW = msgspec.json.Decoder(msgspec.Raw)  # any JSON value; its errors say where they are
_AT_BYTE = re.compile(r"\(byte (\d+)\)")


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
        f" AND strlen({rid}) = length({rid})"
        # an id that is all `-<digits>` is its own run: the statement's regexp leaves it alone
        f" AND NOT starts_with({rid}, '\"-')",
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
        elif key in COUNTS:  # an integer in 0..2**31-1: INTEGER reads it back as its digits
            test = f"TRY_CAST({frag} AS INTEGER)::VARCHAR = {frag} AND NOT starts_with({frag}, '-')"
        elif key == "http_status":
            low, high = HTTP_STATUS
            test = (
                f"TRY_CAST({frag} AS INTEGER)::VARCHAR = {frag}"
                f" AND TRY_CAST({frag} AS INTEGER) BETWEEN {low} AND {high}"
            )
        elif types == (bool,):
            test = f"{frag} IN ('true', 'false')"
        elif types == (list,):
            item = rf"\s*{_DURATION}\s*"
            test = rf"regexp_full_match({frag}, '\[({item}(,{item})*|\s*)\]')"
        elif key in DURATIONS:  # finite and >= 0 (a JSON number's sign is its first byte)
            test = f"isfinite(TRY_CAST({frag} AS DOUBLE)) AND NOT starts_with({frag}, '-')"
        else:
            raise AssertionError(f"no bulk condition for {key}")
        conds.append(f"({key} IS NULL OR {test})")
    return "\n      AND ".join(conds)


# Nesting, for a chunk whose lines are not all flat objects (see `_screen`): a line too short to
# nest deeper than MAX_DEPTH, or one with no more than MAX_DEPTH opening brackets.
_NESTING = (
    f"(strlen(line) <= {2 * MAX_DEPTH + 1}"
    f" OR strlen(line) - strlen(replace(replace(line, '[', ''), '{{', '')) <= {MAX_DEPTH})"
)
_SHAPE = json.dumps({key: "JSON" for key in [*CONTRACT_TYPES, *_EXTRA_KEYS]})
_INSERT = {
    (lines, flat): queries.bulk_insert(
        schema_sql.event_columns(),
        lines,
        _fast_conditions() + ("" if flat else f"\n      AND {_NESTING}"),
    )
    for lines in (queries.BULK_LINES_CSV, queries.BULK_LINES_TEXT)
    for flat in (True, False)
}


Judged = tuple[int, bytes, "Record | str"]  # offset, line, the record or the reason


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
    folder = _chunk_dir(sum(len(p) for p in pieces))
    fd, path = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", suffix=".jsonl", dir=folder)
    try:
        # Two cores' work while DuckDB is idle: the chunk is written and its bytes counted in a
        # thread (both let go of the GIL) while msgspec screens it here; the rare chunk with
        # lines screened out is written again without them.
        counts = _Counts(fd, pieces)
        counts.start()
        kept: list[bytes | memoryview] = []
        suspects: list[tuple[int, bytes]] = []
        objects: list[int | None] = []
        start = offset
        try:
            for piece in pieces:
                piece_kept, piece_objects = _screen(piece, start, suspects)
                kept.extend(piece_kept)
                objects.append(piece_objects)
                start += len(piece)
        finally:
            counts.join()
        counts.check()
        result.lines = counts.lines
        # flat: every line an object without nesting, when each piece decoded as N objects and
        # holds N `{` and no `[`; the statement then skips its count of brackets
        flat = all(n is not None and n == b for n, b in zip(objects, counts.braces, strict=True))
        if suspects:
            _write(fd, kept)
        screened = _judge(suspects)
        inserted, rest = 0, set[bytes]()
        if kept:
            todo = result.lines - len(suspects)
            inserted, rest, new_keys = _insert(con, path, pieces, flat, todo, screened, want_keys)
            result.keys.extend(new_keys)
    finally:
        os.close(fd)
        os.unlink(path)
    result.events += inserted
    judged: list[Judged] = []
    if rest:  # the lines the statement left, where they stand (each judged once)
        aside = {off for off, _line, _doc in screened}
        lines = [(off, line) for off, line in _split(pieces, offset) if off not in aside]
        judged = _judge(lines, only=rest)
    if judged or screened:
        _store_judged(store, con, sorted([*judged, *screened]), source, result)
    return result


def _write(fd: int, pieces: list[bytes] | list[bytes | memoryview]) -> None:
    """`pieces` as the whole content of the chunk file."""
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    for piece in pieces:
        view = memoryview(piece)
        while view:
            view = view[os.write(fd, view) :]


class _Counts(threading.Thread):
    """Writes the pieces to the chunk file and counts, per piece, its lines and (when it holds
    no `[`) its `{`. numpy counts several times faster than `bytes.count`, without the GIL."""

    def __init__(self, fd: int, pieces: list[bytes]) -> None:
        super().__init__(name="servescope-chunk", daemon=True)
        self.fd, self.pieces = fd, pieces
        self.lines = 0
        self.braces: list[int | None] = []
        self.failed: BaseException | None = None

    def run(self) -> None:
        try:
            _write(self.fd, self.pieces)
            for piece in self.pieces:
                octets = np.frombuffer(piece, dtype=np.uint8)
                self.lines += int(np.count_nonzero(octets == ord("\n")))
                nested = b"[" in piece
                self.braces.append(None if nested else int(np.count_nonzero(octets == ord("{"))))
        except BaseException as exc:  # noqa: BLE001 - whatever it is, the caller's thread raises
            self.failed = exc  # it again in `check`: a thread's error must not pass unseen

    def check(self) -> None:
        if self.failed is not None:
            raise self.failed


def _insert(
    con: duckdb.DuckDBPyConnection,
    path: str,
    pieces: list[bytes],
    flat: bool,
    todo: int,
    screened: list[Judged],
    want_keys: bool,
) -> tuple[int, set[bytes], list[tuple[str, str]]]:
    """The bulk statement over the `todo` lines of `path` (those that passed the screen;
    `flat`: all of them objects without nesting): (requests inserted, the lines it left for the
    ordinary path, the keys inserted when asked)."""
    csv = not any(b in p for p in pieces for b in _CSV_UNSAFE) and not any(
        _has_long_line(p, MAX_CSV_LINE) for p in pieces
    )
    lines = queries.BULK_LINES_CSV if csv else queries.BULK_LINES_TEXT
    params: dict[str, int | str] = {"max_line": MAX_CSV_LINE} if csv else {}
    params["path"] = path
    row = con.execute(queries.BULK_LAST_ROWID).fetchone()
    after = int(row[0]) if row else -1
    row = con.execute(_INSERT[(lines, flat)], {**params, "shape": _SHAPE}).fetchone()
    inserted = int(row[0]) if row else 0
    if inserted:
        row = con.execute(queries.BULK_DROP_REPEATED, {"after": after}).fetchone()
        inserted -= int(row[0]) if row else 0
    # a request also on a screened-out line is merged in file order by the ordinary path
    keys = [(run_id_of(d), d["request_id"]) for _o, _l, d in screened if _is_request(d)]
    if inserted and keys:
        row = con.execute(
            queries.BULK_DROP_KEYS,
            {"after": after, "runs": [k[0] for k in keys], "requests": [k[1] for k in keys]},
        ).fetchone()
        inserted -= int(row[0]) if row else 0
    new_keys: list[tuple[str, str]] = []
    if want_keys and inserted:
        new_keys = list(con.execute(queries.BULK_NEW_KEYS, {"after": after}).fetchall())
    rest: set[bytes] = set()
    if inserted < todo:
        rows = con.execute(queries.bulk_rest(lines), {**params, "after": after}).fetchall()
        rest = {line.encode() for (line,) in rows}
    return inserted, rest, new_keys


def _is_request(doc: Record | str) -> TypeIs[EventDoc]:
    return isinstance(doc, dict) and not is_runtime_event(doc)


def _screen(
    piece: bytes, start: int, suspects: list[tuple[int, bytes]]
) -> tuple[list[bytes | memoryview], int | None]:
    """`piece` less its lines that are not strict JSON in valid UTF-8 (DuckDB would take some
    of them: NaN, trailing commas…), which are appended to `suspects` as (offset, line) for
    `parse_line` to judge. One C pass and no copy when every line is good (the common case).

    msgspec reads the lines one after the other; a line that does not end a value is read on
    into the next one, so an error may be reported on a good line after a bad one: that line
    is judged by `parse_line` too, and the bad one is refused by the statement anyway (it is
    not even a lenient JSON object). A line the statement takes is always strict JSON.

    Also the count of objects when every line decoded as one at the first try (else None):
    with as many `{` and no `[` in the piece, no line nests."""
    spans = _bad_utf8(piece)
    view = memoryview(piece)
    i = 0
    decoder: msgspec.json.Decoder[Any] = _OBJECTS
    objects = None
    while i < len(piece):
        try:
            decoded = decoder.decode_lines(view[i:])
            objects = len(decoded) if i == 0 and decoder is _OBJECTS else None
            break
        except msgspec.ValidationError:  # a line that is JSON but no object: the statement
            decoder = _RAW  # refuses it; Raw reads on (and says where it finds an error)
        except msgspec.DecodeError as exc:
            at = _AT_BYTE.search(str(exc))
            if at is None:  # no position given: line by line from here
                spans.extend(_bad_lines(piece, i))
                break
            begin, end = _line_at(piece, i + int(at[1]))
            spans.append((begin, end))
            i = end + 1
        except RecursionError:  # nested past the interpreter's limit: line by line from here
            spans.extend(_bad_lines(piece, i))
            break
    if not spans:
        return [piece], objects
    kept: list[bytes | memoryview] = []
    pos = 0
    for begin, end in sorted(set(spans)):
        if begin < pos:
            continue
        if begin > pos:
            kept.append(view[pos:begin])
        if piece[begin:end].strip():  # a line of other blanks (\v, \f) is blank to every path
            suspects.append((start + begin, piece[begin:end]))
        pos = end + 1
    if pos < len(piece):
        kept.append(view[pos:])
    return kept, None


def _bad_utf8(piece: bytes) -> list[tuple[int, int]]:
    """The line spans of `piece` that are not UTF-8 (DuckDB's readers refuse such a file)."""
    if piece.isascii():  # the common case, without decoding a copy
        return []
    spans = []
    view = memoryview(piece)
    i = 0
    while i < len(piece):
        try:
            str(view[i:], "utf-8")
            break
        except UnicodeDecodeError as exc:
            begin, end = _line_at(piece, i + exc.start)
            spans.append((begin, end))
            i = end + 1
    return spans


def _bad_lines(piece: bytes, i: int) -> list[tuple[int, int]]:
    spans = []
    while i < len(piece):
        end = piece.find(b"\n", i)
        end = len(piece) if end < 0 else end
        line = piece[i:end]
        if line.strip():
            try:
                _RAW.decode(line)
            except (msgspec.DecodeError, RecursionError):
                spans.append((i, end))
        i = end + 1
    return spans


def _line_at(piece: bytes, at: int) -> tuple[int, int]:
    """(start, end) of the line holding byte `at` (`end` is its newline's index)."""
    at = max(0, min(at, len(piece) - 1))
    if piece[at : at + 1] == b"\n" and at > 0:
        at -= 1  # an error reported at a line's end belongs to that line
    begin = piece.rfind(b"\n", 0, at) + 1
    end = piece.find(b"\n", at)
    return begin, len(piece) if end < 0 else end


def remove_stale_chunks() -> None:
    """Delete chunk files left by a process that was killed inside a flush."""
    for folder in {RAM_DIR, tempfile.gettempdir()}:
        with contextlib.suppress(OSError):
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


def _chunk_dir(size: int) -> str | None:
    """RAM-backed when the machine has one with room for a chunk of `size` bytes (with as much
    again to spare): the chunk is read back at once and then deleted. Else the system's temporary
    folder: a container's /dev/shm is 64 MiB by default, and a backlog's chunk is larger."""
    try:
        free = shutil.disk_usage(RAM_DIR).free
    except OSError:
        return None
    return RAM_DIR if free > 2 * size and os.access(RAM_DIR, os.W_OK) else None


def _has_long_line(data: bytes, limit: int) -> bool:
    """Whether `data` may hold a line longer than `limit` (every stretch of limit/2 bytes
    holding a newline proves it does not)."""
    half = limit // 2
    return len(data) > half and any(
        data.find(b"\n", i, i + half) < 0 for i in range(0, len(data) - half, half)
    )


def _split(pieces: list[bytes], offset: int) -> list[tuple[int, bytes]]:
    """(offset, line) of every non-blank line, without its newline and CR (as the statement
    reads it)."""
    lines = []
    for line in b"".join(pieces).split(b"\n"):
        if line.strip():
            lines.append((offset, line.rstrip(b"\r")))
        offset += len(line) + 1
    return lines


def _judge(lines: list[tuple[int, bytes]], only: set[bytes] | None = None) -> list[Judged]:
    """Each line with its record, or with the reason it is refused."""
    judged: list[Judged] = []
    for off, line in lines:
        if only is not None and line not in only:
            continue
        try:
            judged.append((off, line, parse_line(line)))
        except InvalidEvent as exc:
            judged.append((off, line, str(exc)))
    return judged


def _store_judged(
    store: Store,
    con: duckdb.DuckDBPyConnection,
    judged: list[Judged],
    source: str,
    result: BulkResult,
) -> None:
    docs = [doc for _off, _line, doc in judged if isinstance(doc, dict)]
    if docs:
        result.events += store.add_events(docs, con)
        result.keys.extend((run_id_of(d), d["request_id"]) for d in docs if _is_request(d))
    for off, line, reason in judged:
        if isinstance(reason, str):
            store.add_ingest_error(source, off, reason, line, con)
            result.errors.append((off, reason))
