"""One event per request, appended to `<events_dir>/gateway-<UTC date>.events.jsonl`.

Events finished in one turn of the event loop leave together: `write` encodes the line and
queues it, and one `os.write` at the end of the turn appends the batch (at most one turn late,
which the client never waits for: its response is complete before the event is written). Every
write holds whole lines only, so the collector tailing the file never sees half an event. The
file rolls over at UTC midnight. `close()` writes what is queued.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

_encode = json.JSONEncoder(separators=(",", ":")).encode  # built once, not per event


class EventLog:
    def __init__(self, events_dir: Path) -> None:
        self.events_dir = events_dir
        self._fd: int | None = None
        self._roll_at = 0.0
        self._queued: list[str] = []

    def write(self, event: dict[str, Any]) -> None:
        """Queue one event; the file gets it at the end of this turn of the event loop (at once
        when no loop runs)."""
        self._queued.append(_encode(event))
        if len(self._queued) > 1:
            return  # a flush is already scheduled
        try:
            asyncio.get_running_loop().call_soon(self.flush)
        except RuntimeError:
            self.flush()

    def flush(self) -> None:
        if not self._queued:
            return
        data = ("\n".join(self._queued) + "\n").encode()
        self._queued.clear()  # first: a failed write below must not stop later flushes
        now = time.time()
        if now >= self._roll_at or self._fd is None:
            self._open(now)
        assert self._fd is not None
        while data:  # a regular file takes it whole; the loop is for a signal's short write
            data = data[os.write(self._fd, data) :]

    def _open(self, now: float) -> None:
        if self._fd is not None:
            os.close(self._fd)
        date = datetime.fromtimestamp(now, UTC)
        self.events_dir.mkdir(parents=True, exist_ok=True)
        path = self.events_dir / f"gateway-{date:%Y-%m-%d}.events.jsonl"
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._roll_at = (now // 86400 + 1) * 86400  # the next UTC midnight

    def close(self) -> None:
        self.flush()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
