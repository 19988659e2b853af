"""`.events.jsonl` files in and out of the store, line for line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from store.db import Store
from store.events import InvalidEvent, parse_line

BATCH = 10_000


@dataclass
class ImportResult:
    events: int = 0
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

    def flush() -> None:
        if batch:
            store.add_events(batch)
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
        result.events += 1
        result.runs.add(run_id_of(doc))
        if len(batch) >= BATCH:
            flush()
    flush()
    return result


def export_run(store: Store, run_id: str, out: Path) -> int:
    """Write the run's records to `out`, one JSON object per line; returns the count."""
    docs = store.export_events(run_id)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as fh:
        for doc in docs:
            fh.write(json.dumps(doc, ensure_ascii=False) + "\n")
    return len(docs)
