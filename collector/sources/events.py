"""`.events.jsonl` files (the load generator's, the gateway's, anyone's), tailed.

Their lines are not parsed here: a chunk goes into the batch as it was read and the store
loads a run of chunks in one bulk statement at commit (store/bulk.py), which applies the input
rules and quarantines what they refuse. Parsing line by line in Python would cost most of the
ingest time (benchmarks/bench_ingest.py)."""

from __future__ import annotations

from servescope.collector.batch import Batch
from servescope.collector.sources.tailed import Tailed
from servescope.collector.tail import Chunk


class EventsFiles(Tailed):
    """Every file a path or glob matches, one source."""

    kind = "events"

    def take(self, batch: Batch, chunk: Chunk) -> None:
        batch.chunks.append((self.name, chunk))
