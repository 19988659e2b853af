"""The collector: read every source, hold what was read in one pending batch, and commit the
batch — rows, refused input, samples, lever flips and the checkpoints that cover them — in one
short store transaction.

Exactly once follows from that one transaction: after a crash the collector resumes from the
checkpoints of the last commit, so what was read but not committed is read again, and what was
committed is never read again. Pieces of one request (client file, log lines, trace) merge
into one row in the store whatever their order, so re-reading is harmless even across sources.
Transactions stay short (`max_flush_bytes`), so readers in other processes wait at most one
flush; see docs/architecture.md ("Collector").
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from collector import logparse
from collector.scrape import lever_changes, scrape
from collector.selfmetrics import SelfMetrics
from collector.tail import Chunk, Tailer
from store import InvalidEvent, Store, bulk, check_built, checkpoints, run_id_of
from store.metrics import Sample

log = logging.getLogger("servescope.collector")
MAX_FLUSH_BYTES = 256 * 1024 * 1024  # a backlog in few statements: see docs/architecture.md


@dataclass
class FlushReport:
    """One committed flush: what it wrote, and the requests it touched (when asked for)."""

    events: int = 0
    errors: int = 0
    samples: int = 0
    flips: int = 0
    keys: list[tuple[str, str]] = field(default_factory=list)
    lines: Counter[str] = field(default_factory=Counter)  # lines read, by source
    reasons: Counter[str] = field(default_factory=Counter)
    committed_at: float = 0.0
    lag_s: float = 0.0


Exporter = Callable[[FlushReport], None]


@dataclass
class _Pending:
    chunks: list[tuple[str, Chunk]] = field(default_factory=list)  # (source, events chunk)
    docs: list[dict[str, Any]] = field(default_factory=list)
    errors: list[tuple[str, int, str, bytes]] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    flips: list[tuple[str, str | None, str | None, datetime, str]] = field(default_factory=list)
    checkpoints: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    waiters: list[threading.Event] = field(default_factory=list)
    lines: Counter[str] = field(default_factory=Counter)
    oldest: float | None = None
    size: int = 0

    def empty(self) -> bool:
        return not (
            self.chunks
            or self.docs
            or self.errors
            or self.samples
            or self.flips
            or self.checkpoints
            or self.waiters
        )

    def touch(self, size: int = 0) -> None:
        if self.oldest is None:
            self.oldest = time.time()
        self.size += size

    def then(self, newer: _Pending) -> _Pending:
        """This batch followed by `newer` (a failed flush goes back in front)."""
        merged = _Pending(
            self.chunks + newer.chunks,
            self.docs + newer.docs,
            self.errors + newer.errors,
            self.samples + newer.samples,
            self.flips + newer.flips,
            {k: dict(v) for k, v in self.checkpoints.items()},
            self.waiters + newer.waiters,
            self.lines + newer.lines,
            self.oldest if self.oldest is not None else newer.oldest,
            self.size + newer.size,
        )
        for source, rows in newer.checkpoints.items():
            merged.checkpoints.setdefault(source, {}).update(rows)
        return merged


@dataclass
class _LogSource:
    name: str
    tailer: Tailer
    state: dict[str, Any]


def _contiguous(chunks: list[tuple[str, Chunk]]) -> list[tuple[str, list[Chunk]]]:
    """Consecutive chunks of one file, grouped: one bulk statement takes each group, as DuckDB's
    parallel readers pay off on big inputs and each statement has a fixed cost."""
    groups: list[tuple[str, list[Chunk]]] = []
    for source, chunk in chunks:
        last = groups[-1][1][-1] if groups else None
        if last and last.file is chunk.file and last.start + len(last.data) == chunk.start:
            groups[-1][1].append(chunk)
        else:
            groups.append((source, [chunk]))
    return groups


def _checked(piece: logparse.Piece) -> logparse.Piece | logparse.Bad:
    """A piece of a request as the store's rules take it, or the reason they refuse it."""
    try:
        check_built(piece.doc)
    except InvalidEvent as exc:
        return logparse.Bad(str(exc))
    return piece


def reason_class(reason: str) -> str:
    """A refusal reason without its details, as a bounded metric label."""
    return reason.split(":", 1)[0].split("(", 1)[0].strip()[:60] or "unknown"


class Collector:
    """All sources of one `servescope collect`. `poll()` reads, `flush()` commits; `run()` loops
    until stopped, `run_once()` drains the files and returns."""

    def __init__(
        self,
        store: Store,
        *,
        vllm_logs: list[str] | tuple[str, ...] = (),
        events: list[str] | tuple[str, ...] = (),
        metrics_urls: list[str] | tuple[str, ...] = (),
        scrape_interval: float = 5.0,
        once: bool = False,
        flush_interval: float = 0.25,
        poll_interval: float = 0.1,
        max_flush_bytes: int = MAX_FLUSH_BYTES,
        want_keys: bool = False,
        metrics: SelfMetrics | None = None,
    ) -> None:
        self.store = store
        bulk.remove_stale_chunks()
        self.once = once
        self.scrape_interval = scrape_interval
        self.flush_interval = flush_interval
        self.poll_interval = poll_interval
        self.max_flush_bytes = max_flush_bytes
        self.want_keys = want_keys
        self.metrics = metrics or SelfMetrics()
        self.exporters: list[Exporter] = []
        self.totals: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._pending = _Pending()
        self.logs: list[_LogSource] = []
        for path in (os.path.abspath(p) for p in vllm_logs):  # a checkpoint outlives the cwd
            name = f"vllm-log:{path}"
            saved = checkpoints.load(store, name)
            files = [r for r in saved if r["file_key"] != checkpoints.STATE_KEY]
            self.logs.append(
                _LogSource(name, Tailer(path, files, once=once), checkpoints.state_of(saved))
            )
        self.event_files: list[tuple[str, Tailer]] = []
        for pattern in (os.path.abspath(p) for p in events):
            name = f"events:{pattern}"
            rows = [r for r in checkpoints.load(store, name) if r["file_key"]]
            self.event_files.append((name, Tailer(pattern, rows, once=once)))
        self.targets: dict[str, dict[str, Any]] = {
            url: checkpoints.state_of(checkpoints.load(store, f"metrics:{url}"))
            for url in metrics_urls
        }

    # -- reading -------------------------------------------------------------------------------

    def poll(self) -> int:
        """Read what the files have that is new; returns the bytes read."""
        read = 0
        for name, tailer in self.event_files:
            for chunk in tailer.poll():
                read += chunk.too_long or len(chunk.data) or 1  # a skipped line was read too
                with self._lock:
                    self._pending.touch(len(chunk.data))
                    if chunk.too_long:
                        self._too_long(name, chunk)
                    else:
                        self._pending.chunks.append((name, chunk))
                    self._checkpoint(name, tailer.checkpoints())
            self._new_files(name, tailer)
        for source in self.logs:
            for chunk in source.tailer.poll():
                read += chunk.too_long or len(chunk.data) or 1  # a skipped line was read too
                with self._lock:
                    self._pending.touch(len(chunk.data))
                    if chunk.too_long:
                        self._too_long(source.name, chunk)
                    else:
                        self._log_chunk(source, chunk)
                    self._checkpoint(source.name, source.tailer.checkpoints())
            self._new_files(source.name, source.tailer)
        return read

    def _new_files(self, source: str, tailer: Tailer) -> None:
        """A file is checkpointed as soon as it is seen, so a restart can find it after a
        rotation even if nothing of it was read yet."""
        rows = tailer.checkpoints()
        if rows:
            with self._lock:
                self._pending.touch()
                self._checkpoint(source, rows)

    def _checkpoint(self, source: str, rows: list[dict[str, Any]]) -> None:
        table = self._pending.checkpoints.setdefault(source, {})
        for row in rows:
            table[row["file_key"]] = row

    def _too_long(self, source: str, chunk: Chunk) -> None:
        reason = f"line too long ({chunk.too_long} bytes)"
        self._pending.errors.append((chunk.file.error_source, chunk.start, reason, chunk.data))
        self._pending.lines[source] += 1

    def _log_chunk(self, source: _LogSource, chunk: Chunk) -> None:
        offset = chunk.start
        lines = chunk.data.split(b"\n")
        if chunk.data.endswith(b"\n"):
            lines.pop()
        state_changed = False
        access: Counter[tuple[str, str, str]] = Counter()
        for line in lines:
            here, offset = offset, offset + len(line) + 1
            if not line.strip():
                continue
            self._pending.lines[source.name] += 1
            item = logparse.parse_line(line, year=chunk.year)
            if isinstance(item, logparse.Piece):
                item = _checked(item)
            if isinstance(item, logparse.Piece):
                self._pending.docs.append(item.doc)
            elif isinstance(item, logparse.Bad):
                self._pending.errors.append((chunk.file.error_source, here, item.reason, line))
            elif isinstance(item, logparse.Stats):
                ts = (item.ts or datetime.now(UTC)).replace(tzinfo=None)
                for key, value in item.values.items():
                    self._pending.samples.append(
                        (ts, source.name, f"vllm_log:{key}", {"engine": item.engine}, None, value)
                    )
            elif isinstance(item, logparse.Access):
                access[(item.method, item.path, str(item.status))] += 1
            elif isinstance(item, logparse.Levers):
                before = source.state.get("levers")
                if before is not None:
                    ts = (item.ts or datetime.now(UTC)).replace(tzinfo=None)
                    for lever, old, new in lever_changes(before, item.levers):
                        self._flip(lever, old, new, ts, f"non-default args in {source.name}")
                source.state["levers"] = item.levers
                state_changed = True
        now = datetime.now(UTC).replace(tzinfo=None)
        for (method, path, status), n in access.items():
            labels = {"method": method, "path": path, "status": status}
            self._pending.samples.append(
                (now, source.name, "vllm_log:http_responses", labels, None, float(n))
            )
        if state_changed:
            self._checkpoint(
                source.name, [{"file_key": checkpoints.STATE_KEY, "state": source.state}]
            )

    def _flip(self, lever: str, old: Any, new: Any, ts: datetime, note: str) -> None:
        before = None if old is None else json.dumps(old)
        after = None if new is None else json.dumps(new)
        self._pending.flips.append((lever, before, after, ts, note))

    def submit(
        self, pieces: list[dict[str, Any]], refused: list[tuple[str, str]], source: str = "otlp"
    ) -> threading.Event:
        """Pieces and refusals from a receiver thread; the event is set once they are committed."""
        done = threading.Event()
        good = []
        refused = list(refused)
        for piece in pieces:
            try:
                good.append(check_built(piece))
            except InvalidEvent as exc:  # the store's rules hold for pieces of traces too
                refused.append((str(exc), repr(piece)[:4096]))
        pieces = good
        with self._lock:
            self._pending.touch()
            self._pending.docs.extend(pieces)
            self._pending.lines[source] += len(pieces) + len(refused)
            for i, (reason, raw) in enumerate(refused):
                self._pending.errors.append((source, time.time_ns() + i, reason, raw.encode()))
            self._pending.waiters.append(done)
        return done

    def scrape_all(self) -> None:
        """Scrape every `/metrics` target once into the pending batch."""
        for url, state in self.targets.items():
            result = scrape(url, timeout=min(5.0, max(1.0, self.scrape_interval)))
            with self._lock:
                self._pending.touch()
                self._pending.samples.extend(result.samples)
                self._pending.lines[f"metrics:{url}"] += 1
                if result.error and result.body:
                    self._pending.errors.append(
                        (url, time.time_ns(), result.error, result.body[:65536].encode())
                    )
                if result.cache_levers is not None:
                    before = state.get("cache_levers")
                    if before is not None:
                        ts = result.samples[-1][0]
                        for lever, old, new in lever_changes(before, result.cache_levers):
                            self._flip(lever, old, new, ts, f"vllm:cache_config_info of {url}")
                    if before != result.cache_levers:
                        state["cache_levers"] = result.cache_levers
                        self._checkpoint(
                            f"metrics:{url}", [{"file_key": checkpoints.STATE_KEY, "state": state}]
                        )

    # -- committing ----------------------------------------------------------------------------

    def pending_bytes(self) -> int:
        return self._pending.size

    def flush(self) -> FlushReport | None:
        """Commit everything read so far in one transaction; None when there was nothing.

        On failure the batch goes back in front of what was read meanwhile, and is retried by
        the next flush: nothing read is ever dropped.
        """
        with self._lock:
            batch, self._pending = self._pending, _Pending()
        if batch.empty():
            return None
        try:
            report = self._commit(batch)
        except BaseException:
            with self._lock:
                self._pending = batch.then(self._pending)
            raise
        for done in batch.waiters:
            done.set()
        self._account(batch, report)
        for exporter in self.exporters:
            try:
                exporter(report)
            except Exception:  # an exporter must never stop ingestion
                log.exception("exporter %r failed", exporter)
        return report

    def _commit(self, batch: _Pending) -> FlushReport:
        report = FlushReport(lines=Counter(batch.lines))
        with self.store.write() as con:
            for source, group in _contiguous(batch.chunks):
                result = bulk.ingest_lines(
                    self.store,
                    con,
                    [chunk.data for chunk in group],
                    source=group[0].file.error_source,
                    offset=group[0].start,
                    want_keys=self.want_keys,
                )
                report.lines[source] += result.lines
                report.events += result.events
                report.keys.extend(result.keys)
                for _off, reason in result.errors:
                    report.reasons[reason_class(reason)] += 1
            if batch.docs:
                report.events += self.store.add_events(batch.docs, con)
                if self.want_keys:
                    report.keys.extend((run_id_of(d), d["request_id"]) for d in batch.docs)
            for source, offset, reason, raw in batch.errors:
                self.store.add_ingest_error(source, offset, reason, raw, con)
                report.reasons[reason_class(reason)] += 1
            report.errors = sum(report.reasons.values())
            self.store.add_metric_samples(batch.samples, con)
            report.samples = len(batch.samples)
            for lever, before, after, ts, note in batch.flips:
                self.store.add_lever_flip(lever, before, after, ts=ts, note=note, con=con)
            report.flips = len(batch.flips)
            for source, rows in batch.checkpoints.items():
                checkpoints.save(con, source, rows.values())
        report.committed_at = time.time()
        report.lag_s = report.committed_at - (batch.oldest or report.committed_at)
        return report

    def _account(self, batch: _Pending, report: FlushReport) -> None:
        m = self.metrics
        for source, n in report.lines.items():
            m.lines.labels(source).inc(n)
        m.events.inc(report.events)
        for reason, n in report.reasons.items():
            m.errors.labels(reason).inc(n)
        for lever, before, after, ts, _note in batch.flips:
            m.flips.labels(lever, before or "", after or "").set(ts.replace(tzinfo=UTC).timestamp())
        m.lag.set(report.lag_s)
        m.last_flush.set(report.committed_at)
        self.totals["events"] += report.events
        self.totals["errors"] += report.errors
        self.totals["flips"] += report.flips
        self.totals["samples"] += report.samples

    # -- loops ---------------------------------------------------------------------------------

    def run_once(self, on_read: Callable[[int], None] | None = None) -> None:
        """Ingest everything the files hold now (and one scrape of each target), then return.
        `on_read(bytes)` is told of every read (a progress bar)."""
        if self.targets:
            self.scrape_all()
        while True:
            read = self.poll()
            if on_read is not None:
                on_read(read)
            if self.pending_bytes() >= self.max_flush_bytes or not read:
                self.flush()
            if not read:
                break
        self.close()

    def run(self, stop: threading.Event) -> None:
        """Tail, scrape and flush until `stop` is set; then a last read and flush."""
        scraper = None
        if self.targets:
            scraper = threading.Thread(target=self._scrape_loop, args=(stop,), daemon=True)
            scraper.start()
        last_flush = time.monotonic()
        while not stop.is_set():
            read = self.poll()
            full = self.pending_bytes() >= self.max_flush_bytes
            backlog = read >= 1 << 20  # catching up: fill the flush, fewer and bigger commits
            since = time.monotonic() - last_flush
            if full or not backlog and (since >= self.flush_interval or not read):
                last_flush = time.monotonic()  # from its start: slow flushes run back to back
                try:
                    self.flush()
                except Exception:
                    log.exception("flush failed; the batch is kept and retried")
                    stop.wait(1.0)
            if not full and not backlog:  # a trickle: wait for more, never spin on it
                wait = self.poll_interval if not read else self.flush_interval - since
                stop.wait(max(0.0, min(self.poll_interval, wait)))
        while self.poll():
            if self.pending_bytes() >= self.max_flush_bytes:
                self.flush()
        self.flush()
        if scraper is not None:
            scraper.join(timeout=10)
        self.close()

    def _scrape_loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                self.scrape_all()
            except Exception:
                log.exception("scrape failed")
            stop.wait(max(0.0, self.scrape_interval - (time.monotonic() - started)))

    def backlog_bytes(self) -> int:
        """Bytes in the tailed files not read yet."""
        tailers = [s.tailer for s in self.logs] + [t for _n, t in self.event_files]
        return sum(t.lag_bytes() for t in tailers)

    def close(self) -> None:
        for source in self.logs:
            source.tailer.close()
        for _name, tailer in self.event_files:
            tailer.close()
