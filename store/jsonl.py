"""`.events.jsonl` files in and out of the store, line for line."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from servescope.store.db import Store
from servescope.store.runtime import RuntimeCursor
from servescope.store.validation import (
    MAX_LINE_BYTES,
    InvalidEvent,
    Record,
    dumps,
    is_runtime_event,
    parse_line,
    run_id_of,
)

BATCH = 10_000
_READ = MAX_LINE_BYTES + 2  # a longest line with its CR LF


@dataclass
class ImportResult:
    events: int = 0  # request records
    runtime_events: int = 0  # agent-runtime lines (tool calls, approvals…), stored verbatim
    errors: int = 0
    runs: set[str] = field(default_factory=set)
    examples: list[tuple[int, str]] = field(default_factory=list)  # the first refusals

    def took(self, doc: Record) -> None:
        """A line stored: a request record or a runtime event, of its run."""
        if is_runtime_event(doc):
            self.runtime_events += 1
        else:
            self.events += 1
        self.runs.add(run_id_of(doc))

    def refused(self, offset: int, reason: str) -> None:
        """A line refused at `offset` (the first three kept as examples, with their reason)."""
        self.errors += 1
        if len(self.examples) < 3:
            self.examples.append((offset, reason))


def read_lines(path: Path) -> Iterator[tuple[int, bytes, int]]:
    """(byte offset, line, its length) for every complete or final line of the file. A line
    longer than the rules allow is never held whole: its head comes with its full length."""
    offset = 0
    with path.open("rb") as fh:
        while line := fh.readline(_READ):
            length = len(line)
            if length == _READ and not line.endswith(b"\n"):
                while (more := fh.readline(1 << 20)) and not more.endswith(b"\n"):
                    length += len(more)
                length += len(more)
            yield offset, line, length
            offset += length


def import_file(
    store: Store, path: Path, on_read: Callable[[int], None] | None = None
) -> ImportResult:
    """Import every valid record; quarantine every other line in `ingest_errors` with a reason.
    `on_read(bytes)` is told of the bytes read (a progress bar)."""
    result = ImportResult()
    batch: list[Record] = []
    errors: list[tuple[int, str, bytes]] = []
    source = str(path)
    cursor = RuntimeCursor()
    read = 0

    def flush() -> None:
        nonlocal read
        if batch or errors:
            with store.write() as con:
                store.add_events(batch, con, cursor=cursor)
                for offset, reason, raw in errors:
                    store.add_ingest_error(source, offset, reason, raw, con)
            batch.clear()
            errors.clear()
        if on_read is not None:
            on_read(read)
            read = 0

    for offset, line, length in read_lines(path):
        read += length
        if not line.strip():
            continue
        try:
            doc = _parsed(line, length)
        except InvalidEvent as exc:
            errors.append((offset, str(exc), line))
            result.refused(offset, str(exc))
        else:
            batch.append(doc)
            result.took(doc)
        if len(batch) + len(errors) >= BATCH:
            flush()
    flush()
    return result


def _parsed(line: bytes, length: int) -> Record:
    """A line read whole (`length` is what it had: more than `line` when it was cut)."""
    if length > len(line):
        raise InvalidEvent(f"line too long ({length} bytes; the limit is {MAX_LINE_BYTES})")
    return parse_line(line)


def export_run(store: Store, run_id: str, out: Path) -> int:
    """Write the run's records and agent-runtime events to `out`, one JSON object per line, in
    the order they had in their file; returns the count of lines."""
    docs = store.export_lines(run_id)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as fh:
        for doc in docs:
            fh.write(dumps(doc, ensure_ascii=False) + "\n")
    return len(docs)
