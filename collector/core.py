"""The collector: a loop over its sources (collector/sources/), which add what they read to one
pending batch (collector/batch.py), and the flush that commits the batch — rows, refused
input, samples, lever flips and the checkpoints that cover them — in one short store
transaction (collector/writer.py), then counts it on the collector's own `/metrics`.

Exactly once follows from that one transaction: after a crash the collector resumes from the
checkpoints of the last commit, so what was read but not committed is read again, and what was
committed is never read again. Pieces of one request (client file, log lines, trace) merge
into one row in the store whatever their order, so re-reading is harmless even across sources.
Transactions stay short (`max_flush_bytes`), so readers in other processes wait at most one
flush; see docs/design.md ("Collector").
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import UTC, timedelta

from servescope.collector.batch import Intake
from servescope.collector.selfmetrics import SelfMetrics
from servescope.collector.sources import Source
from servescope.collector.writer import FlushReport, StoreWriter
from servescope.store import Store, bulk, retention
from servescope.store.lake import LakeWriter
from servescope.store.lakecompact import compact, expire

log = logging.getLogger("servescope.collector")
MAX_FLUSH_BYTES = 256 * 1024 * 1024  # a backlog in few statements: see docs/design.md
COMPACT_INTERVAL_S = 30.0  # how often the lake's small files of this sidecar are compacted
EXPIRE_EVERY = 120  # compaction passes between two expiries and VACUUMs of the lake (an hour)

Exporter = Callable[[FlushReport], None]


def failure_reason(exc: BaseException) -> str:
    """A failed flush's cause as a metric label: `disk_full` (the store's or the lake's disk;
    DuckDB and the OS word it differently), else the exception's class."""
    text = str(exc).lower()
    if isinstance(exc, OSError) and exc.errno == 28 or "no space left" in text:
        return "disk_full"
    if "not enough space" in text:
        return "disk_full"
    return type(exc).__name__


class Collector:
    """The sources of one `servescope collect`. `poll()` reads the tailed ones, `scrape_all()`
    the periodic ones, `flush()` commits; `run()` loops until stopped, `run_once()` drains the
    files and returns. Each source resumes from its checkpoints here, in the constructor.
    `instance` names the host in the ids of the server sessions it makes (collector/sessions.py;
    None: the older ids without it)."""

    def __init__(
        self,
        store: Store,
        sources: Sequence[Source] = (),
        *,
        scrape_interval: float = 5.0,
        once: bool = False,
        flush_interval: float = 0.25,
        poll_interval: float = 0.1,
        max_flush_bytes: int = MAX_FLUSH_BYTES,
        want_keys: bool = False,
        metrics: SelfMetrics | None = None,
        lake: LakeWriter | None = None,
        instance: str | None = None,
        retain: timedelta | None = None,
        retain_interval_s: float = retention.INTERVAL_S,
    ) -> None:
        self.store = store
        self.lake = lake
        self.retain = retain  # metric samples older than this are dropped (--retain)
        # … and those older than a day downsampled, every `retain_interval_s` (store/retention.py)
        self.retention = retention.Retention(store, retain) if retain is not None else None
        self.retain_interval_s = retain_interval_s
        bulk.remove_stale_chunks()
        self.once = once
        self.scrape_interval = scrape_interval
        self.flush_interval = flush_interval
        self.poll_interval = poll_interval
        self.max_flush_bytes = max_flush_bytes
        self.metrics = metrics or SelfMetrics()
        self.exporters: list[Exporter] = []
        self.totals: Counter[str] = Counter()
        self.intake = Intake(
            store,
            self.metrics,
            once=once,
            scrape_interval=scrape_interval,
            max_bytes=max_flush_bytes,
            instance=instance,
        )
        self.writer = StoreWriter(store, self.intake.attribution, lake=lake, want_keys=want_keys)
        self.sources = list(sources)
        self._started = False
        for source in self.sources:
            source.open(self.intake)

    def start(self) -> None:
        """Start the sources that receive (bind their ports); an OSError says one cannot."""
        if not self._started:
            self._started = True
            for source in self.sources:
                source.start()

    # -- reading -------------------------------------------------------------------------------

    def poll(self) -> int:
        """Read what the tailed sources have that is new; returns the bytes read."""
        return sum(source.poll() for source in self.sources if not source.periodic)

    def scrape_all(self) -> None:
        """Poll every periodic source once (each `/metrics` target scraped, the GPUs read); the
        scrapes wait for `flush` to find the server session they belong to."""
        for source in self.sources:
            if source.periodic:
                source.poll()

    def pending_bytes(self) -> int:
        return self.intake.pending_bytes()

    def backlog_bytes(self) -> int:
        """Bytes in the tailed files not read yet."""
        return sum(source.backlog() for source in self.sources)

    # -- committing ----------------------------------------------------------------------------

    def flush(self) -> FlushReport | None:
        """Commit everything read so far in one transaction; None when there was nothing.

        On failure the batch goes back in front of what was read meanwhile, and is retried by
        the next flush: nothing read is ever dropped.
        """
        batch = self.intake.take()
        if batch.empty():
            if self.lake is not None and self.lake.behind():
                self._catch_up_lake()
            return None
        try:
            report = self.writer.commit(batch)
        except BaseException as exc:
            self.intake.put_back(batch)
            self._flush_failed(exc)
            raise
        self._flush_recovered()
        for done in batch.waiters:
            done.set()
        self._account(report)
        for exporter in self.exporters:
            try:
                exporter(report)
            except Exception:  # an exporter must never stop ingestion
                log.exception("exporter %r failed", exporter)
        return report

    def _catch_up_lake(self) -> None:
        """The lake's unwritten flushes, written with nothing new read (a failure counts as a
        failed flush: a full disk says so even when the input has stopped)."""
        assert self.lake is not None
        try:
            self.lake.drain()
        except BaseException as exc:
            self._flush_failed(exc)
            raise
        self._flush_recovered()

    def _flush_failed(self, exc: BaseException) -> None:
        """Count the failure; say it once, in one log line, when flushes start failing."""
        reason = failure_reason(exc)
        self.metrics.flush_failures.labels(reason).inc()
        self.metrics.flush_failing.set(1)
        self.metrics.pending.set(self.pending_bytes())
        if self.intake.failing is None:
            log.error(
                "flush failed (%s: %s); nothing is lost: the batch and the checkpoints are kept, "
                "files are read on up to %d MiB pending, the flush is retried every second",
                reason, str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__,
                self.max_flush_bytes >> 20,
            )  # fmt: skip
            log.debug("flush failure", exc_info=exc)
        self.intake.failing = reason

    def _flush_recovered(self) -> None:
        if self.intake.failing is not None:
            log.warning("flushes commit again (after %s); catching up", self.intake.failing)
            self.intake.failing = None
            self.metrics.flush_failing.set(0)

    def _account(self, report: FlushReport) -> None:
        m = self.metrics
        for source, n in report.lines.items():
            m.lines.labels(source).inc(n)
        m.events.inc(report.events)
        for reason, n in report.reasons.items():
            m.errors.labels(reason).inc(n)
        for lever, before, after, ts in report.flipped:
            when = ts.replace(tzinfo=UTC).timestamp()
            m.flips.labels(lever, before or "unset", after or "unset").set(when)
        m.lag.set(report.lag_s)
        m.last_flush.set(report.committed_at)
        self.totals["events"] += report.events
        self.totals["errors"] += report.errors
        self.totals["flips"] += report.flips
        self.totals["samples"] += report.samples

    # -- loops ---------------------------------------------------------------------------------

    def run_once(self, on_read: Callable[[int], None] | None = None) -> None:
        """Ingest everything the files hold now (and one scrape of each target), then return.
        `on_read(bytes)` is told of every read (a progress bar). The scrape comes after the
        files are read, so a GPU reading finds the server sessions the log started."""
        while True:
            read = self.poll()
            if on_read is not None:
                on_read(read)
            if self.pending_bytes() >= self.max_flush_bytes or not read:
                self.flush()
            if not read:
                break
        self.scrape_all()
        self.flush()
        while not self.apply_retention():
            pass
        self.compact_lake()
        self.close()

    def run(self, stop: threading.Event) -> None:
        """Tail, scrape and flush until `stop` is set; then a last read and flush."""
        self.start()
        caught_up = threading.Event()  # the scrapes start once the files' backlog is read
        helpers = self._start_helpers(stop, caught_up)
        self._ingest(stop, caught_up)
        self._drain()
        for thread, join_s in helpers:
            thread.join(timeout=join_s)
        self.close()

    def _start_helpers(
        self, stop: threading.Event, caught_up: threading.Event
    ) -> list[tuple[threading.Thread, float]]:
        """The scrape loop (when a source is periodic) and the lake's upkeep (with a lake),
        started; each with how long a stop waits for it."""
        helpers = []
        if any(source.periodic for source in self.sources):
            loop = threading.Thread(target=self._scrape_loop, args=(stop, caught_up))
            helpers.append((loop, 10.0))
        if self.lake is not None:
            helpers.append((threading.Thread(target=self._compact_loop, args=(stop,)), 60.0))
        for thread, _join_s in helpers:
            thread.daemon = True
            thread.start()
        return helpers

    def _ingest(self, stop: threading.Event, caught_up: threading.Event) -> None:
        """The ingest loop: read, flush when the batch is full or due, retention when due."""
        last_flush = next_retention = time.monotonic()  # retention: once at start
        while not stop.is_set():
            # bounded memory: while flushes fail, reading stops at one flush's worth pending
            # (the files keep the rest; the checkpoints have not moved)
            read = self.poll() if self.pending_bytes() < self.max_flush_bytes else 0
            self.metrics.pending.set(self.pending_bytes())
            full = self.pending_bytes() >= self.max_flush_bytes
            backlog = read >= 1 << 20  # catching up: fill the flush, fewer and bigger commits
            if not backlog and not full:
                caught_up.set()  # the sessions the backlog started are known (read, not flushed)
            since = time.monotonic() - last_flush
            if full or not backlog and (since >= self.flush_interval or not read):
                last_flush = time.monotonic()  # from its start: slow flushes run back to back
                self._flush_or_wait(stop)
            if not full and not backlog:  # a trickle: wait for more, never spin on it
                wait = self.poll_interval if not read else self.flush_interval - since
                stop.wait(max(0.0, min(self.poll_interval, wait)))
            if self.retention is not None and time.monotonic() >= next_retention:
                done = self.apply_retention()  # a backlog of it: a slice, then a flush, …
                next_retention = time.monotonic() + (self.retain_interval_s if done else 0.0)

    def _flush_or_wait(self, stop: threading.Event) -> None:
        try:
            self.flush()
        except Exception:  # noqa: BLE001 - the loop must outlive any flush failure; flush logged it, the batch is kept and retried
            stop.wait(1.0)

    def _drain(self) -> None:
        """After `stop`: what the sources still hold, read and flushed."""
        try:
            while self.poll():
                if self.pending_bytes() >= self.max_flush_bytes:
                    self.flush()
            self.flush()
        except Exception:  # noqa: BLE001 - stopping must finish whatever the last flush hit; flush said it, what was not committed is read again at the next start
            log.warning("stopping with %d bytes read but not committed: the next start reads "
                        "them again from the checkpoints", self.pending_bytes())  # fmt: skip

    def apply_retention(self) -> bool:
        """One retention pass over the metric samples (store/retention.py), counted on the
        collector's /metrics; False when it stopped at its time budget with more to do. A
        failure (the store busy, a full disk) is logged and retried at the next pass."""
        if self.retention is None:
            return True
        try:
            if self.lake is not None:  # its unwritten flushes count on the samples' rowids
                self.lake.drain()
            result = self.retention.apply()
        except Exception as exc:  # noqa: BLE001 - the ingest loop calls this; no store failure may stop it
            log.warning("metric retention failed (%s); retried later", failure_reason(exc))
            return True
        self.metrics.pruned.labels("expired").inc(result.dropped)
        self.metrics.pruned.labels("downsampled").inc(result.downsampled)
        self.totals["samples_dropped"] += result.dropped
        self.totals["samples_downsampled"] += result.downsampled
        return result.done

    def _scrape_loop(self, stop: threading.Event, caught_up: threading.Event) -> None:
        """The periodic sources, every scrape interval; one failing never stops the others.

        The first scrape waits for the tailed files' backlog to be read: until then the
        collector does not know which server sessions are running, and a GPU reading would be
        stored as no server's (a `/metrics` scrape waits for its session anyway)."""
        while not (caught_up.wait(0.5) or stop.is_set()):
            pass
        while not stop.is_set():
            started = time.monotonic()
            for source in self.sources:
                if not source.periodic:
                    continue
                try:
                    source.poll()
                except Exception:
                    log.exception("%s failed", source.name)
            stop.wait(max(0.0, self.scrape_interval - (time.monotonic() - started)))

    def _compact_loop(self, stop: threading.Event) -> None:
        """The lake's upkeep in the background (store/lakecompact.py): compaction every pass,
        expiry and VACUUM every `EXPIRE_EVERY` passes (the first one included)."""
        passes = 0
        while not stop.wait(COMPACT_INTERVAL_S):
            self.compact_lake(expire_too=passes % EXPIRE_EVERY == 0)
            passes += 1

    def compact_lake(self, expire_too: bool = False) -> None:
        """One upkeep pass; a failure (a full disk, a commit race lost) is retried at the next
        pass, and leaves the lake as it was."""
        if self.lake is None:
            return
        try:
            compact(self.lake)
            if expire_too:
                expire(self.lake, self.retain)
        except Exception as exc:  # noqa: BLE001 - a background loop: any upkeep failure waits for the next pass
            log.warning("lake upkeep failed (%s); retried later", failure_reason(exc))

    def close(self) -> None:
        """After the last flush: the lake's last events, then the sources let go."""
        if self.lake is not None:
            self.lake.close()  # the last flush, written after its commit
        for source in self.sources:
            source.close()
