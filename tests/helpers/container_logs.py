"""A container runtime's log of a vLLM, as Kubernetes (CRI) or Docker (json-file) writes it: the
lines as the runtime received them, written into its files, read by a collector into a store."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb

from tests.helpers.cli import servescope

# (runtime time, stream, the line as written, without its newline)
Written = tuple[datetime, str, str]


def rfc3339_nano(ts: datetime) -> str:
    """Go's RFC3339Nano: nine digits at most, trailing zeros dropped, `Z` for UTC."""
    fraction = f"{ts.microsecond:06d}123".rstrip("0")  # a nanosecond tail, as runtimes stamp
    return ts.strftime("%Y-%m-%dT%H:%M:%S") + (f".{fraction}" if fraction else "") + "Z"


def cri_records(written: Iterable[Written], max_record: int = 16 * 1024) -> list[str]:
    """The CRI file lines (without newlines) a runtime writes for `written`."""
    out = []
    for ts, stream, text in written:
        data = text.encode()
        pieces = [data[i : i + max_record] for i in range(0, len(data), max_record)] or [b""]
        for n, piece in enumerate(pieces):
            tag = "F" if n == len(pieces) - 1 else "P"
            out.append(f"{rfc3339_nano(ts)} {stream} {tag} {piece.decode(errors='replace')}")
    return out


def docker_records(written: Iterable[Written], max_record: int = 16 * 1024) -> list[str]:
    """The json-file lines Docker writes for `written` (keys in its order)."""
    out = []
    for ts, stream, text in written:
        pieces = [text[i : i + max_record] for i in range(0, len(text), max_record)] or [""]
        for n, piece in enumerate(pieces):
            log = piece + ("\n" if n == len(pieces) - 1 else "")
            record = {"log": log, "stream": stream, "time": rfc3339_nano(ts)}
            out.append(json.dumps(record, separators=(",", ":")))
    return out


DATED = re.compile(r"^\([^)]*\) [A-Z]+ (\d\d-\d\d \d\d:\d\d:\d\d) ")


MAX_RECORD = 256  # containerd's max_container_log_line_size, set low: long lines come split


def written(text: str, year: int) -> list[Written]:
    """The log's lines as the runtime received them: vLLM's own lines (`(APIServer pid=…)`) on
    stdout, the rest (torch's C++ warnings, Python's) on stderr; each stamped a little after
    the second vLLM stamped it, an undated line a millisecond after the line before."""
    out: list[Written] = []
    ts = datetime(year, 1, 1, tzinfo=UTC)
    for line in text.removesuffix("\n").split("\n"):
        match = DATED.match(line)
        if match:
            stamped = datetime.strptime(f"{year}-{match[1]}", "%Y-%m-%d %H:%M:%S")
            ts = max(ts, stamped.replace(tzinfo=UTC) + timedelta(seconds=0.4))
        ts += timedelta(milliseconds=1)
        out.append((ts, "stdout" if line.startswith("(") else "stderr", line))
    return out


def write_log(path: Path, lines: list[str], mtime: datetime) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes("".join(line + "\n" for line in lines).encode())
    os.utime(path, (mtime.timestamp(), mtime.timestamp()))  # a plain log's year is its mtime's
    return path


def collect_log(store: Path, log: Path) -> None:
    servescope("collect", "--once", "--vllm-log", str(log), "--store", str(store),
               env={"TZ": "UTC"}, check=True)  # fmt: skip


def store_contents(store: Path) -> dict[str, Any]:
    """What the store holds, less what names the file it was read from: the runs (a run's
    notes name its log), the requests, the refusals (their id is their place in the file)."""
    with duckdb.connect(str(store), read_only=True) as con:
        con.execute("SET TimeZone = 'UTC'")
        runs = []
        query = "SELECT * EXCLUDE (notes), notes FROM runs ORDER BY run_id"
        for row in con.execute(query).fetchall():
            notes = json.loads(row[-1])
            notes.pop("log")
            runs.append((*row[:-1], notes))
        requests = con.execute(
            "SELECT * EXCLUDE (doc) FROM events WHERE request_id NOT LIKE 'http-%' "
            "ORDER BY request_id"
        ).fetchall()
        refusals = con.execute(
            "SELECT * EXCLUDE (request_id, doc) FROM events WHERE request_id LIKE 'http-%' "
            "ORDER BY ALL"
        ).fetchall()
        flips = con.execute("SELECT * FROM lever_flips ORDER BY ALL").fetchall()
        errors = con.execute("SELECT count(*) FROM ingest_errors").fetchone()
    return {"runs": runs, "requests": requests, "refusals": refusals, "flips": flips,
            "errors": errors}  # fmt: skip
