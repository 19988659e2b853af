"""One event per request, appended to `<events_dir>/gateway-<UTC date>.events.jsonl`.

Each event is one complete line written with a single `write` and flushed at once, so the
collector tailing the file never sees half an event; the file rolls over at UTC midnight.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any


class EventLog:
    def __init__(self, events_dir: Path) -> None:
        self.events_dir = events_dir
        self._date: str | None = None
        self._file: IO[str] | None = None
        self._roll_at = 0.0

    @property
    def path(self) -> Path:
        return self.events_dir / f"gateway-{datetime.now(UTC).strftime('%Y-%m-%d')}.events.jsonl"

    def write(self, event: dict[str, Any]) -> None:
        now = time.time()
        if now >= self._roll_at or self._file is None:
            self.close()
            date = datetime.fromtimestamp(now, UTC)
            self.events_dir.mkdir(parents=True, exist_ok=True)
            self._file = (self.events_dir / f"gateway-{date:%Y-%m-%d}.events.jsonl").open(
                "a", encoding="utf-8"
            )
            self._date = f"{date:%Y-%m-%d}"
            self._roll_at = (now // 86400 + 1) * 86400  # the next UTC midnight
        self._file.write(json.dumps(event, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
