"""A vLLM `/metrics` URL, scraped every scrape interval (collector/scrape.py). A scrape's
samples wait in the attribution until the server session they belong to is known (the log may
announce a restart after the scrape saw the new process), and go into the batch at a flush with
the target's state (`Intake.take`)."""

from __future__ import annotations

import time

from servescope.collector.batch import Intake, scrape_source
from servescope.collector.scrape import scrape, server_version
from servescope.collector.sources import Source
from servescope.store import checkpoints

MAX_KEPT_BODY = 65536  # of a page that is not exposition format, what ingest_errors keeps


class MetricsTarget(Source):
    """One `/metrics` URL. A target that is down is a sample (`up` 0), never an error."""

    periodic = True
    intake: Intake

    def __init__(self, url: str) -> None:
        self.url = url
        self.name = scrape_source(url)

    def open(self, intake: Intake) -> None:
        self.intake = intake
        state = checkpoints.state_of(checkpoints.load(intake.store, self.name))
        intake.attribution.follow_target(self.url, state)

    def poll(self) -> int:
        """One scrape. None while flushes fail: nothing can be stored now, and counters are
        cumulative, so the next scrape has what this one would have had."""
        intake = self.intake
        if intake.failing is not None:
            return 0
        result = scrape(self.url, timeout=min(5.0, max(1.0, intake.scrape_interval)))
        restarted = intake.attribution.restarted(result)
        version = server_version(self.url) if restarted else None  # a new server behind the URL
        with intake.batch() as batch:
            batch.touch()
            batch.lines[self.name] += 1
            if result.error and result.body:
                raw = result.body[:MAX_KEPT_BODY].encode()
                batch.errors.append((self.url, time.time_ns(), result.error, raw))
            intake.attribution.hold(result, version)
        return 1
