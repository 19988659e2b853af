"""A container's stdout and stderr as its runtime keeps them → the lines the application wrote.

In Kubernetes a container's output is a file under `/var/log/pods/…`, one record per line in
the CRI format: `<RFC 3339 time> stdout|stderr F|P <text>`. The runtime splits a long line into
partial `P` records closed by an `F` (containerd at 16 KiB by default). Docker's json-file
driver keeps `{"log": "<text>\\n", "stream": "stdout", "time": "<RFC 3339 time>"}` instead, and
splits a long line the same way: a record whose `log` does not end in a newline is partial.

`Unwrapper` reads one such file's lines, one by one, and gives back each line the application
wrote whole, with the runtime's time and stream. The format is recognized per line, so a plain
log (what vLLM writes to a file itself) goes through unchanged: the collector reads all three
without being told which it has. Both streams are kept: vLLM logs to stdout and Python's
warnings and tracebacks go to stderr. Partial records are joined per stream, since the runtime
may interleave the two streams' records.

A line the runtime split is held in memory until its final record comes. The collector's
checkpoint covers the records it read, partial ones too, so a collector restarted between a
line's partial records and its final one reads the bytes before its checkpoint again
(`Unwrapper.resume`): the split line waits for its final record as if nothing had stopped.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypeVar

import msgspec

# `2026-11-27T00:01:02.123456789Z stdout F text`: RFC 3339 with any fraction (RFC3339Nano
# drops trailing zeros) and a zone; the tag is `P` or `F`, possibly with more after a colon.
_CRI = re.compile(
    rb"^(?P<ts>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:\d\d)) "
    rb"(?P<stream>stdout|stderr) (?P<tags>[PF](?::[A-Za-z0-9]+)*)(?: (?P<text>.*))?$",
    re.DOTALL,
)
_FRACTION = re.compile(r"\.(\d{6})\d+")
_DOCKER_PREFIX = b'{"log":'
HEAD_BYTES = 64 * 1024  # what is kept of a joined line longer than the caller's bound

T = TypeVar("T")


class _DockerRecord(msgspec.Struct):
    log: str
    stream: str = ""
    time: str = ""


_DOCKER = msgspec.json.Decoder(_DockerRecord)


@dataclass(frozen=True)
class Record:
    """One line as the application wrote it, without its newline. `ts` and `stream` are the
    runtime's (None for a plain line); `too_long` is the joined line's length when it exceeded
    the bound, and `text` then holds only its head."""

    text: bytes
    ts: datetime | None = None
    stream: str | None = None
    too_long: int = 0


def runtime_time(text: str) -> datetime | None:
    """An RFC 3339 time as a container runtime writes it, in UTC (nanoseconds cut to
    microseconds); None when it is not one."""
    try:
        ts = datetime.fromisoformat(_FRACTION.sub(r".\1", text.strip()).replace("Z", "+00:00"))
    except ValueError:
        return None
    return ts.astimezone(UTC) if ts.tzinfo is not None else None


@dataclass
class _Pending:
    """A stream's partial records so far: the head of the line (at most the bound) and the
    length of the whole, with the time of the first record."""

    ts: datetime | None
    parts: list[bytes]
    kept: int = 0
    length: int = 0


class Unwrapper:
    """One file's records → the application's lines. Feed it the file's lines in order; it
    keeps the partial records of each stream until their final one."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._pending: dict[str, _Pending] = {}

    @property
    def lookback(self) -> int:
        """How far before a place in the file the partial records of a line split there may
        start: a line within the bound, in records with the runtime's prefixes."""
        return self.max_bytes + HEAD_BYTES

    def resume(self, before: bytes, *, whole: bool) -> None:
        """Reading resumes after `before`, the `lookback` bytes before that place in the file
        (from the file's start when `whole`): the lines split there, whose partial records a
        restarted collector had read and checkpointed, wait again for their final records."""
        self._pending.clear()
        lines = before.split(b"\n")[:-1]  # the last: what follows the last newline
        for line in lines if whole else lines[1:]:  # the window's first line may be cut
            if line.strip():
                self.feed(line)

    @property
    def pending(self) -> bool:
        """Whether a line split by the runtime waits for its final record."""
        return bool(self._pending)

    def feed(self, line: bytes) -> Record | None:
        """The line the record `line` completes (`line` without its newline), or None while a
        split line waits for its final record. A line in neither runtime format is a plain
        line, given back as it is."""
        if line[:1].isdigit():
            match = _CRI.match(line)
            if match is not None:
                ts = runtime_time(match["ts"].decode("ascii"))
                if ts is not None:
                    partial = "P" in match["tags"].decode("ascii").split(":")
                    text = match["text"] or b""
                    return self._join(match["stream"].decode("ascii"), ts, text, partial)
        elif line.startswith(_DOCKER_PREFIX):
            try:
                record = _DOCKER.decode(line)
            except (msgspec.DecodeError, RecursionError):  # RecursionError: nested too deep
                return Record(line)  # the log parser says why the line is bad
            text = record.log.encode("utf-8", "surrogatepass")
            partial = not text.endswith(b"\n")
            text = text.removesuffix(b"\n")
            stream = record.stream or "stdout"
            return self._join(stream, runtime_time(record.time), text, partial)
        return Record(line)

    def _join(self, stream: str, ts: datetime | None, text: bytes, partial: bool) -> Record | None:
        pending = self._pending.get(stream)
        if pending is None:
            if not partial:
                return self._bounded(Record(text, ts, stream))
            pending = self._pending[stream] = _Pending(ts, [])
        room = self.max_bytes - pending.kept
        if room > 0:
            pending.parts.append(text[:room])
            pending.kept += min(len(text), room)
        pending.length += len(text)
        if partial:
            return None
        del self._pending[stream]
        whole = b"".join(pending.parts)
        if pending.length > self.max_bytes:
            return Record(whole[:HEAD_BYTES], pending.ts, stream, too_long=pending.length)
        return Record(whole, pending.ts, stream)

    def _bounded(self, record: Record) -> Record:
        if len(record.text) <= self.max_bytes:
            return record
        return Record(record.text[:HEAD_BYTES], record.ts, record.stream, len(record.text))


def dated(item: T, ts: datetime | None) -> T:
    """`item` (a parsed line with a `ts` field) dated by the runtime's time `ts` when the line
    itself carried none (uvicorn's access lines, its `Application startup complete`). The time
    is cut to whole seconds, the precision of vLLM's own text stamps: the times a run's lines
    give are compared with each other (a start-up's length, a refusal within its run), and a
    runtime's stamp is a little later than the one vLLM put on the line it wrote just before."""
    if ts is None or getattr(item, "ts", ts) is not None:
        return item
    if not dataclasses.is_dataclass(item) or isinstance(item, type):
        return item
    return dataclasses.replace(item, ts=ts.replace(microsecond=0))
