"""What the two tailed sources share (`.events.jsonl` files and vLLM logs): the tail loop that
hands each chunk to the source with the offsets it was read up to, in one step under the
batch's lock, so no batch ever holds a line without its checkpoint or the other way round."""

from __future__ import annotations

import os
from abc import abstractmethod
from typing import Any, cast

from servescope.collector.batch import Batch, Intake
from servescope.collector.sources import Source
from servescope.collector.tail import CheckpointRow, Chunk, Tailer
from servescope.store import checkpoints


class Tailed(Source):
    """A path or glob followed like `tail -F` (collector/tail.py). Subclasses say what a chunk
    of complete lines becomes (`take`)."""

    kind = ""  # the name's prefix: `events`, `vllm-log`
    periodic = False
    intake: Intake
    tailer: Tailer

    def __init__(self, pattern: str) -> None:
        self.pattern = os.path.abspath(pattern)  # a checkpoint outlives the cwd
        self.name = f"{self.kind}:{self.pattern}"

    def open(self, intake: Intake) -> None:
        self.intake = intake
        self.resume(checkpoints.load(intake.store, self.name))

    def resume(self, saved: list[dict[str, Any]]) -> None:
        """Follow the files from the offsets of the last commit (the rows `Tailer` wrote)."""
        files = [
            cast(CheckpointRow, row) for row in saved if row["file_key"] != checkpoints.STATE_KEY
        ]
        self.tailer = Tailer(self.pattern, files, once=self.intake.once)

    def poll(self) -> int:
        read = 0
        for chunk in self.tailer.poll():
            read += chunk.too_long or len(chunk.data) or 1  # a skipped line was read too
            with self.intake.batch() as batch:
                batch.touch(len(chunk.data))
                if chunk.too_long:
                    batch.too_long(self.name, chunk)
                else:
                    self.take(batch, chunk)
                batch.checkpoint(self.name, self.tailer.checkpoints())
        self._new_files()
        return read

    @abstractmethod
    def take(self, batch: Batch, chunk: Chunk) -> None:
        """A chunk of complete lines into the batch (called under its lock)."""

    def _new_files(self) -> None:
        """A file is checkpointed as soon as it is seen, so a restart can find it after a
        rotation even if nothing of it was read yet."""
        rows = self.tailer.checkpoints()
        if rows:
            with self.intake.batch() as batch:
                batch.touch()
                batch.checkpoint(self.name, rows)

    def backlog(self) -> int:
        return self.tailer.lag_bytes()

    def close(self) -> None:
        self.tailer.close()
