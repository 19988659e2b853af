"""The pending batch: everything the sources read since the last committed flush, and the one
lock they add to it under.

One batch is one store transaction (collector/writer.py), so what a source reads and the
checkpoint that says it was read always travel together: that is the exactly-once rule, and it
is why a source never writes to the store itself, only to the batch.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypedDict

from servescope.collector.attribution import Attribution
from servescope.collector.selfmetrics import SelfMetrics
from servescope.collector.sessions import Session
from servescope.collector.tail import CheckpointRow, Chunk
from servescope.store import Store, checkpoints
from servescope.store.validation import EventDoc
from servescope.wire.exposition import Sample

# A refused piece of input: (source, offset, reason, the raw bytes), for `ingest_errors`.
Refusal = tuple[str, int, str, bytes]


class StateRow(TypedDict):
    """A source's state (its server session, a target's), checkpointed beside its files."""

    file_key: str  # checkpoints.STATE_KEY
    state: Mapping[str, object]


def scrape_source(url: str) -> str:
    """The source name of a `/metrics` target: its checkpoint's key and its `lines` label."""
    return f"metrics:{url}"


@dataclass
class Batch:
    """What was read and not committed yet, in the shapes the store writes."""

    chunks: list[tuple[str, Chunk]] = field(default_factory=list)  # (source, events chunk)
    docs: list[EventDoc] = field(default_factory=list)  # request pieces
    errors: list[Refusal] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    sessions: dict[str, Session] = field(default_factory=dict)  # runs rows to write, by run
    checkpoints: dict[str, dict[str, CheckpointRow | StateRow]] = field(default_factory=dict)
    waiters: list[threading.Event] = field(default_factory=list)  # set once committed
    lines: Counter[str] = field(default_factory=Counter)  # lines read, by source
    oldest: float | None = None
    size: int = 0

    def empty(self) -> bool:
        return not (
            self.chunks
            or self.docs
            or self.errors
            or self.samples
            or self.sessions
            or self.checkpoints
            or self.waiters
        )

    def touch(self, size: int = 0) -> None:
        """Something was added: the batch's age (the lag it reports) starts at its first input."""
        if self.oldest is None:
            self.oldest = time.time()
        self.size += size

    def checkpoint(self, source: str, rows: Sequence[CheckpointRow | StateRow]) -> None:
        """Offsets a source was read up to, keyed by file: a later row of a file replaces the
        earlier one, so the batch holds each file's furthest offset."""
        table = self.checkpoints.setdefault(source, {})
        for row in rows:
            table[row["file_key"]] = row

    def checkpoint_state(self, source: str, state: Mapping[str, object]) -> None:
        """A source's state (its server session) goes with the offsets it was read up to."""
        self.checkpoint(source, [{"file_key": checkpoints.STATE_KEY, "state": state}])

    def too_long(self, source: str, chunk: Chunk) -> None:
        """A line over the store's bound: kept in `ingest_errors` by its head, never whole."""
        reason = f"line too long ({chunk.too_long} bytes)"
        self.errors.append((chunk.file.error_source, chunk.start, reason, chunk.data))
        self.lines[source] += 1

    def then(self, newer: Batch) -> Batch:
        """This batch followed by `newer` (a failed flush goes back in front)."""
        merged = Batch(
            self.chunks + newer.chunks,
            self.docs + newer.docs,
            self.errors + newer.errors,
            self.samples + newer.samples,
            {**self.sessions, **newer.sessions},
            {k: dict(v) for k, v in self.checkpoints.items()},
            self.waiters + newer.waiters,
            self.lines + newer.lines,
            self.oldest if self.oldest is not None else newer.oldest,
            self.size + newer.size,
        )
        for source, rows in newer.checkpoints.items():
            merged.checkpoints.setdefault(source, {}).update(rows)
        return merged


class Intake:
    """What every source is given: the pending batch behind its lock, the store its checkpoints
    are loaded from, the attribution of things to server sessions (shared by the log, scrape,
    GPU and trace sources, which is why it lives here and not in one of them), the collector's
    own `/metrics` (a source may publish series of its own) and the settings a source needs.
    The collector swaps the batch out to flush it."""

    def __init__(
        self,
        store: Store,
        metrics: SelfMetrics,
        *,
        once: bool = False,
        scrape_interval: float = 5.0,
        max_bytes: int,
        instance: str | None = None,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.once = once
        self.scrape_interval = scrape_interval
        self.max_bytes = max_bytes
        self.attribution = Attribution(instance)
        self.failing: str | None = None  # why flushes fail now (None: they commit)
        self._lock = threading.Lock()
        self._pending = Batch()

    @contextmanager
    def batch(self) -> Iterator[Batch]:
        """The pending batch, held under the lock for the `with` block (keep it short: every
        source and the flush wait on it)."""
        with self._lock:
            yield self._pending

    def pending_bytes(self) -> int:
        return self._pending.size

    def refusing(self) -> bool:
        """Whether a pushed input must be refused now: flushes fail and a flush's worth waits
        already (the pusher retries later; memory stays bounded)."""
        return self.failing is not None and self.pending_bytes() >= self.max_bytes

    def take(self) -> Batch:
        """The batch to commit, with the sessions that changed and the scrapes whose session
        is known now; a fresh batch takes its place."""
        with self._lock:
            attribution = self.attribution
            if attribution.holding():
                for url, samples, state in attribution.place_scrapes():
                    self._pending.samples.extend(samples)
                    self._pending.checkpoint_state(scrape_source(url), state)
            self._pending.sessions.update(attribution.changed())
            batch, self._pending = self._pending, Batch()
        return batch

    def put_back(self, batch: Batch) -> None:
        """A batch whose flush failed, back in front of what was read meanwhile."""
        with self._lock:
            self._pending = batch.then(self._pending)
