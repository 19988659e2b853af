"""vLLM's OTLP traces as a source: the receiver (collector/otlp.py) decodes each export into
request pieces and refusals, and this source puts them into the batch with an event the
receiver waits on, so an export is answered only once what it carried is committed: an exporter
that got 200 can forget its spans, one that got no answer sends them again."""

from __future__ import annotations

import threading
import time
from typing import Any

from servescope.collector.batch import Intake
from servescope.collector.otlp import OtlpReceiver
from servescope.collector.sources import Source
from servescope.store import InvalidEvent, check_built


class OtlpTraces(Source):
    """`POST /v1/traces` on `host:port` (port 0: any free one, see `port` once started)."""

    periodic = False
    intake: Intake

    def __init__(self, host: str = "127.0.0.1", port: int = 4318) -> None:
        self.name = "otlp"
        self.host = host
        self._port = port
        self.receiver: OtlpReceiver | None = None

    @property
    def port(self) -> int:
        return int(self.receiver.port) if self.receiver is not None else self._port

    def open(self, intake: Intake) -> None:
        self.intake = intake

    def start(self) -> None:
        self.receiver = OtlpReceiver(self.submit, self.host, self._port).start()

    def poll(self) -> int:
        return 0  # what is sent arrives through `submit`

    def submit(
        self, pieces: list[dict[str, Any]], refused: list[tuple[str, str]]
    ) -> threading.Event:
        """Pieces and refusals of one export (a receiver thread); the event is set once they
        are committed. While flushes fail with a flush's worth pending it is never set: the
        receiver answers 503 and the exporter retries."""
        done = threading.Event()
        good = []
        refused = list(refused)
        for piece in pieces:
            try:
                good.append(check_built(piece))
            except InvalidEvent as exc:  # the store's rules hold for pieces of traces too
                refused.append((str(exc), repr(piece)[:4096]))
        intake = self.intake
        if intake.refusing():
            return done
        with intake.batch() as batch:
            batch.touch()
            batch.docs.extend(good)
            batch.lines[self.name] += len(good) + len(refused)
            for i, (reason, raw) in enumerate(refused):
                batch.errors.append((self.name, time.time_ns() + i, reason, raw.encode()))
            batch.waiters.append(done)
        return done

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.stop()
            self.receiver = None
