"""`.events.jsonl` files in and out of the store, line for line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from store.db import Store
from store.events import InvalidEvent, is_runtime_event, parse_line
from store.runtime import RuntimeCursor

BATCH = 10_000


@dataclass
class ImportResult:
    events: int = 0  # request records
    runtime_events: int = 0  # agent-runtime lines (tool calls, approvals…), stored verbatim
    errors: int = 0
    runs: set[str] = field(default_factory=set)


def read_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(byte offset, line) for every complete or final line of the file."""
    offset = 0
    with path.open("rb") as fh:
        for line in fh:
            yield offset, line
            offset += len(line)


def import_file(store: Store, path: Path) -> ImportResult:
    """Import every valid record; quarantine every other line in `ingest_errors` with a reason."""
    from store.events import run_id_of

    result = ImportResult()
    batch: list[dict[str, Any]] = []
    source = str(path)
    cursor = RuntimeCursor()

    def flush() -> None:
        if batch:
            store.add_events(batch, cursor=cursor)
            batch.clear()

    for offset, line in read_lines(path):
        if not line.strip():
            continue
        try:
            doc = parse_line(line)
        except InvalidEvent as exc:
            store.add_ingest_error(source, offset, str(exc), line.rstrip(b"\n"))
            result.errors += 1
            continue
        batch.append(doc)
        if is_runtime_event(doc):
            result.runtime_events += 1
        else:
            result.events += 1
        result.runs.add(run_id_of(doc))
        if len(batch) >= BATCH:
            flush()
    flush()
    return result


def export_run(store: Store, run_id: str, out: Path) -> int:
    """Write the run's records and agent-runtime events to `out`, one JSON object per line, in
    the order they had in their file; returns the count of lines."""
    docs = store.export_lines(run_id)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as fh:
        for doc in docs:
            fh.write(json.dumps(doc, ensure_ascii=False) + "\n")
    return len(docs)
