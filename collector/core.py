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

import duckdb

from servescope.collector.gpu import GpuSource
from servescope.collector.scrape import scrape, server_version
from servescope.collector.selfmetrics import SelfMetrics
from servescope.collector.sessions import Attribution, ServerLog, Session, parse_ts
from servescope.collector.tail import Chunk, Tailer
from servescope.store import InvalidEvent, Store, bulk, check_built, checkpoints, run_id_of
from servescope.store.lake import LakeWriter, Written
from servescope.store.lakecompact import compact
from servescope.wire import vllm_log
from servescope.wire.exposition import Sample
from servescope.wire.ids import UNATTRIBUTED_RUN

log = logging.getLogger("servescope.collector")
MAX_FLUSH_BYTES = 256 * 1024 * 1024  # a backlog in few statements: see docs/architecture.md
COMPACT_INTERVAL_S = 30.0  # how often the lake's small files of this sidecar are merged


def failure_reason(exc: BaseException) -> str:
    """A failed flush's cause as a metric label: `disk_full` (the store's or the lake's disk;
    DuckDB and the OS word it differently), else the exception's class."""
    text = str(exc).lower()
    if isinstance(exc, OSError) and exc.errno == 28 or "no space left" in text:
        return "disk_full"
    if "not enough space" in text:
        return "disk_full"
    return type(exc).__name__


# Request paths whose refusals are requests that failed (a 4xx/5xx access line with no id).
INFERENCE_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/embeddings",
        "/v1/score",
        "/v1/rerank",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        "/pooling",
        "/classify",
        "/score",
        "/rerank",
        "/invocations",
        "/inference/v1/generate",
    }
)


@dataclass
class FlushReport:
    """One committed flush: what it wrote, and the requests it touched (when asked for)."""

    events: int = 0
    errors: int = 0
    samples: int = 0
    flips: int = 0
    flipped: list[tuple[str, str | None, str | None, datetime]] = field(default_factory=list)
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
    sessions: dict[str, Session] = field(default_factory=dict)  # runs rows to write, by run
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
            or self.sessions
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


@dataclass
class _LogSource:
    name: str
    tailer: Tailer
    server: ServerLog  # the server lifetimes the log holds, as far as it was read
    # Wall time of the last poll that read the log to its end (None: not caught up, or --once)
    caught_up: float | None = None


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


def _checked(piece: vllm_log.Piece) -> vllm_log.Piece | vllm_log.Bad:
    """A piece of a request as the store's rules take it, or the reason they refuse it."""
    try:
        check_built(piece.doc)
    except InvalidEvent as exc:
        return vllm_log.Bad(str(exc))
    return piece


def reason_class(reason: str) -> str:
    """A refusal reason without its details, as a bounded metric label."""
    return reason.split(":", 1)[0].split("(", 1)[0].strip()[:60] or "unknown"


def _json(value: Any) -> str | None:
    """A lever value in the one spelling every flip uses (JSON: `true`, `128`, `"auto"`)."""
    return None if value is None else json.dumps(value)


def _later(written: datetime | None, session: Session | None) -> str | None:
    """An undated line's time: when it was read live, never before the server's last dated
    line; else that line's time."""
    last = session.last_ts if session is not None else None
    if written is None:
        return last
    floor = parse_ts(last)
    return (max(written, floor) if floor is not None else written).isoformat()


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
        gpu: GpuSource | None = None,
        lake: LakeWriter | None = None,
    ) -> None:
        self.store = store
        self.gpu = gpu
        self.lake = lake
        self.failing: str | None = None  # why flushes fail now (None: they commit)
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
        self.attribution = Attribution()  # which server session each thing read belongs to
        self.logs: list[_LogSource] = []
        for path in (os.path.abspath(p) for p in vllm_logs):  # a checkpoint outlives the cwd
            name = f"vllm-log:{path}"
            saved = checkpoints.load(store, name)
            files = [r for r in saved if r["file_key"] != checkpoints.STATE_KEY]
            server = self.attribution.follow_log(name, checkpoints.state_of(saved))
            self.logs.append(_LogSource(name, Tailer(path, files, once=once), server))
        self.event_files: list[tuple[str, Tailer]] = []
        for pattern in (os.path.abspath(p) for p in events):
            name = f"events:{pattern}"
            rows = [r for r in checkpoints.load(store, name) if r["file_key"]]
            self.event_files.append((name, Tailer(pattern, rows, once=once)))
        for url in metrics_urls:
            state = checkpoints.state_of(checkpoints.load(store, f"metrics:{url}"))
            self.attribution.follow_target(url, state)

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
            read += self._poll_log(source)
        return read

    def _poll_log(self, source: _LogSource) -> int:
        """Read a vLLM log's new lines. When the last poll had read it to the end, what this one
        finds was written since: `written` (now) dates its undated lines (uvicorn's access lines),
        within a poll interval; a backlog or `--once` has no such bound."""
        read = 0
        written = datetime.now(UTC) if source.caught_up is not None and not self.once else None
        for chunk in source.tailer.poll():
            read += chunk.too_long or len(chunk.data) or 1  # a skipped line was read too
            with self._lock:
                self._pending.touch(len(chunk.data))
                if chunk.too_long:
                    self._too_long(source.name, chunk)
                else:
                    self._log_chunk(source, chunk, written)
                self._checkpoint(source.name, source.tailer.checkpoints())
        self._new_files(source.name, source.tailer)
        source.caught_up = time.time() if source.tailer.lag_bytes() == 0 else None
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

    def _checkpoint_state(self, source: str, state: dict[str, Any]) -> None:
        """A source's state (its server session) goes with the offsets it was read up to."""
        self._checkpoint(source, [{"file_key": checkpoints.STATE_KEY, "state": state}])

    def _too_long(self, source: str, chunk: Chunk) -> None:
        reason = f"line too long ({chunk.too_long} bytes)"
        self._pending.errors.append((chunk.file.error_source, chunk.start, reason, chunk.data))
        self._pending.lines[source] += 1

    def _log_chunk(self, source: _LogSource, chunk: Chunk, written: datetime | None = None) -> None:
        offset = chunk.start
        lines = chunk.data.split(b"\n")
        if chunk.data.endswith(b"\n"):
            lines.pop()
        server = source.server
        before = server.snapshot()
        access: Counter[tuple[str, str, str]] = Counter()
        for line in lines:
            here, offset = offset, offset + len(line) + 1
            if not line.strip():
                continue
            self._pending.lines[source.name] += 1
            item = vllm_log.parse_line(line, year=chunk.year)
            if isinstance(item, vllm_log.Piece):
                item = _checked(item)
            if isinstance(item, vllm_log.Piece):
                server.seen(parse_ts(item.doc.get("log_ts")))
                self._pending.docs.append(server.attribute(item.doc))
            elif isinstance(item, vllm_log.Tick):
                server.seen(item.ts)
            elif isinstance(item, vllm_log.Bad):
                self._pending.errors.append((chunk.file.error_source, here, item.reason, line))
            elif isinstance(item, vllm_log.Stats):
                server.seen(item.ts)
                ts = (item.ts or datetime.now(UTC)).replace(tzinfo=None)
                run = server.run_id
                for key, value in item.values.items():
                    self._pending.samples.append(
                        (ts, source.name, f"vllm_log:{key}", {"engine": item.engine}, run, value)
                    )
            elif isinstance(item, vllm_log.Access):
                access[(item.method, item.path, str(item.status))] += 1
                if item.status >= 400 and item.path.split("?", 1)[0] in INFERENCE_PATHS:
                    self._refused(item, server, chunk, here, written)
            elif isinstance(item, vllm_log.Startup):
                server.startup(item)
            elif isinstance(item, vllm_log.Levers):
                server.configure(item)
            elif isinstance(item, vllm_log.KvCache):
                server.kv_cache(item)
                self._kv_samples(source.name, item, server.run_id)
            elif isinstance(item, vllm_log.Phase):
                server.phase(item)
        now = datetime.now(UTC).replace(tzinfo=None)
        for (method, path, status), n in access.items():
            labels = {"method": method, "path": path, "status": status}
            self._pending.samples.append(
                (now, source.name, "vllm_log:http_responses", labels, server.run_id, float(n))
            )
        state = server.changed_state(before)
        if state is not None:
            self._checkpoint_state(source.name, state)

    def _kv_samples(self, source: str, item: vllm_log.KvCache, run: str | None) -> None:
        """vLLM's start-up KV-cache statement as samples `vllm_log:kv_cache_tokens{device}` and
        `vllm_log:max_concurrency{max_model_len}` of the session's run."""
        ts = (item.ts or datetime.now(UTC)).replace(tzinfo=None)
        if "kv_cache_tokens" in item.values:
            device = {"device": str(item.values.get("kv_cache_device", ""))}
            value = float(item.values["kv_cache_tokens"])
            self._pending.samples.append(
                (ts, source, "vllm_log:kv_cache_tokens", device, run, value)
            )
        if "max_concurrency" in item.values:
            labels = {"max_model_len": str(item.values["max_model_len"])}
            value = float(item.values["max_concurrency"])
            self._pending.samples.append(
                (ts, source, "vllm_log:max_concurrency", labels, run, value)
            )

    def _refused(
        self,
        item: vllm_log.Access,
        server: ServerLog,
        chunk: Chunk,
        offset: int,
        written: datetime | None = None,
    ) -> None:
        """An access line answering an inference request with 4xx/5xx: vLLM refused or failed
        a request it logged no id for, and a request that failed still counts. Its id is its
        place in the log file, so reading the line again gives the same event. A text access
        line has no time: it is dated when it was read live (`written`), else at the server's
        last dated line (its lower bound: a backlog or `--once`)."""
        if item.status == 429:
            status, error = "rejected", "rejected:http_429"
        else:
            status, error = "error", f"http_{item.status // 100}xx"
        ts = item.ts.isoformat() if item.ts else _later(written, server.session)
        doc: dict[str, Any] = {
            "request_id": f"http-{chunk.file.fp[:8] or 'log'}-{offset}",
            "run_id": server.run_id or UNATTRIBUTED_RUN,
            "source": vllm_log.SOURCE,
            "log_ts": ts,
            "status": status,
            "http_status": item.status,
            "error": error,
            "http_method": item.method,
            "http_path": item.path,
        }
        server.attribute(doc)
        self._pending.docs.append({k: v for k, v in doc.items() if v is not None})

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
        if self.failing is not None and self.pending_bytes() >= self.max_flush_bytes:
            return done  # never set: the receiver answers 503 and the exporter retries
        with self._lock:
            self._pending.touch()
            self._pending.docs.extend(pieces)
            self._pending.lines[source] += len(pieces) + len(refused)
            for i, (reason, raw) in enumerate(refused):
                self._pending.errors.append((source, time.time_ns() + i, reason, raw.encode()))
            self._pending.waiters.append(done)
        return done

    def scrape_all(self) -> None:
        """Scrape every `/metrics` target once; the samples wait for `flush` to find the
        server session they belong to."""
        if self.failing is not None:
            return  # nothing can be stored now; counters are cumulative, the next scrape has it
        for url in self.attribution.targets:
            result = scrape(url, timeout=min(5.0, max(1.0, self.scrape_interval)))
            restarted = self.attribution.restarted(result)
            version = server_version(url) if restarted else None  # a new server behind the URL
            with self._lock:
                self._pending.touch()
                self._pending.lines[f"metrics:{url}"] += 1
                if result.error and result.body:
                    self._pending.errors.append(
                        (url, time.time_ns(), result.error, result.body[:65536].encode())
                    )
                self.attribution.hold(result, version)

    def read_gpu(self) -> None:
        """One reading of the GPUs (`collector/gpu.py`), each GPU's samples stored as the
        running server session's that uses it (`gpu.owners`: by process, else by its
        `CUDA_VISIBLE_DEVICES`); a GPU several servers share is no session's (the reports
        take those too, by time)."""
        if self.gpu is None:
            return

        def running() -> list[Session]:
            with self._lock:
                sessions = self.attribution.sessions()
            return [s for s in sessions if s.ended_at is None and s.run_id]

        samples = self.gpu.read(running)
        self.metrics.gpu_servers(self.gpu.owned)
        with self._lock:
            self._pending.touch()
            self._pending.lines[f"gpu:{self.gpu.name}"] += 1
            self._pending.samples.extend(samples)

    def _place_scrapes(self) -> None:
        """Held scrapes whose session is known: their samples and their target's state into
        the batch (called under the lock)."""
        for url, samples, state in self.attribution.place_scrapes():
            self._pending.samples.extend(samples)
            self._checkpoint_state(f"metrics:{url}", state)

    # -- committing ----------------------------------------------------------------------------

    def pending_bytes(self) -> int:
        return self._pending.size

    def flush(self) -> FlushReport | None:
        """Commit everything read so far in one transaction; None when there was nothing.

        On failure the batch goes back in front of what was read meanwhile, and is retried by
        the next flush: nothing read is ever dropped.
        """
        with self._lock:
            if self.attribution.holding():
                self._place_scrapes()
            self._pending.sessions.update(self.attribution.changed())
            batch, self._pending = self._pending, _Pending()
        if batch.empty():
            return None
        try:
            report = self._commit(batch)
        except BaseException as exc:
            with self._lock:
                self._pending = batch.then(self._pending)
            self._flush_failed(exc)
            raise
        self._flush_recovered()
        for done in batch.waiters:
            done.set()
        self._account(batch, report)
        for exporter in self.exporters:
            try:
                exporter(report)
            except Exception:  # an exporter must never stop ingestion
                log.exception("exporter %r failed", exporter)
        return report

    def _flush_failed(self, exc: BaseException) -> None:
        """Count the failure; say it once, in one log line, when flushes start failing."""
        reason = failure_reason(exc)
        self.metrics.flush_failures.labels(reason).inc()
        self.metrics.flush_failing.set(1)
        self.metrics.pending.set(self.pending_bytes())
        if self.failing is None:
            log.error(
                "flush failed (%s: %s); nothing is lost: the batch and the checkpoints are kept, "
                "files are read on up to %d MiB pending, the flush is retried every second",
                reason, str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__,
                self.max_flush_bytes >> 20,
            )  # fmt: skip
            log.debug("flush failure", exc_info=exc)
        self.failing = reason

    def _flush_recovered(self) -> None:
        if self.failing is not None:
            log.warning("flushes commit again (after %s); catching up", self.failing)
            self.failing = None
            self.metrics.flush_failing.set(0)

    def _commit(self, batch: _Pending) -> FlushReport:
        written: Written | None = None
        try:
            with self.store.write() as con:
                mark = self.lake.mark(con) if self.lake is not None else None
                report = self._write(batch, con)
                if self.lake is not None and mark is not None:
                    # the flush's rows into the lake before the store commits them, with the
                    # lake's flush number in the same transaction (store/lake.py)
                    groups = [
                        (s.run_id, s.previous)
                        for s in batch.sessions.values()
                        if s.run_id and s.previous
                    ]
                    written = self.lake.write(
                        con, mark, runs=list(batch.sessions), flip_groups=groups
                    )
        except BaseException:
            if self.lake is not None:
                self.lake.failed(written)
            raise
        if self.lake is not None:
            self.lake.committed(written)
        report.committed_at = time.time()
        report.lag_s = report.committed_at - (batch.oldest or report.committed_at)
        return report

    def _write(self, batch: _Pending, con: duckdb.DuckDBPyConnection) -> FlushReport:
        """The batch into the store, inside the flush's transaction."""
        report = FlushReport(lines=Counter(batch.lines))
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
            self.attribution.place_pieces(batch.docs, self.store, con)
            report.events += self.store.add_events(batch.docs, con)
            if self.want_keys:
                report.keys.extend((run_id_of(d), d["request_id"]) for d in batch.docs)
        for source, offset, reason, raw in batch.errors:
            self.store.add_ingest_error(source, offset, reason, raw, con)
            report.reasons[reason_class(reason)] += 1
        report.errors = sum(report.reasons.values())
        self.store.add_metric_samples(batch.samples, con)
        report.samples = len(batch.samples)
        for session in batch.sessions.values():
            self._write_session(session, con, report)
        for source, rows in batch.checkpoints.items():
            checkpoints.save(con, source, rows.values())
        return report

    def _write_session(
        self, session: Session, con: duckdb.DuckDBPyConnection, report: FlushReport
    ) -> None:
        """A session's `runs` row, and its flips: one row per lever that differs from the
        session before it, naming both runs (written again whole when its levers change)."""
        assert session.run_id is not None
        self.store.upsert_run(session.run_id, con, **session.run_row())
        if session.previous is None or session.previous_levers is None:
            return
        ts = session.started()
        assert ts is not None
        at = ts.astimezone(UTC).replace(tzinfo=None)
        rows = [(lever, _json(old), _json(new)) for lever, old, new in session.flips()]
        note = f"server restarted: {session.previous} -> {session.run_id}"
        written = self.store.replace_flips(session.run_id, session.previous, rows, at, note, con)
        report.flips += written
        report.flipped.extend((lever, before, after, at) for lever, before, after in rows)

    def _account(self, batch: _Pending, report: FlushReport) -> None:
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
        `on_read(bytes)` is told of every read (a progress bar)."""
        if self.attribution.targets:
            self.scrape_all()
        while True:
            read = self.poll()
            if on_read is not None:
                on_read(read)
            if self.pending_bytes() >= self.max_flush_bytes or not read:
                self.flush()
            if not read:
                break
        self.compact_lake()
        self.close()

    def run(self, stop: threading.Event) -> None:
        """Tail, scrape and flush until `stop` is set; then a last read and flush."""
        scraper = None
        if self.attribution.targets or self.gpu is not None:
            scraper = threading.Thread(target=self._scrape_loop, args=(stop,), daemon=True)
            scraper.start()
        compactor = None
        if self.lake is not None:
            compactor = threading.Thread(target=self._compact_loop, args=(stop,), daemon=True)
            compactor.start()
        last_flush = time.monotonic()
        while not stop.is_set():
            # bounded memory: while flushes fail, reading stops at one flush's worth pending
            # (the files keep the rest; the checkpoints have not moved)
            read = self.poll() if self.pending_bytes() < self.max_flush_bytes else 0
            self.metrics.pending.set(self.pending_bytes())
            full = self.pending_bytes() >= self.max_flush_bytes
            backlog = read >= 1 << 20  # catching up: fill the flush, fewer and bigger commits
            since = time.monotonic() - last_flush
            if full or not backlog and (since >= self.flush_interval or not read):
                last_flush = time.monotonic()  # from its start: slow flushes run back to back
                try:
                    self.flush()
                except Exception:  # logged once by flush; the batch is kept and retried
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
        if compactor is not None:
            compactor.join(timeout=60)
        self.close()

    def _compact_loop(self, stop: threading.Event) -> None:
        """Merge this sidecar's small lake files in the background (store/lakecompact.py)."""
        while not stop.wait(COMPACT_INTERVAL_S):
            self.compact_lake()

    def compact_lake(self) -> None:
        """One compaction pass over the flushes committed so far; a failure (a full disk) is
        retried at the next pass, and leaves the lake as it was."""
        if self.lake is None:
            return
        try:
            compact(self.lake.root, self.lake.sidecar, self.lake.published)
        except Exception as exc:
            log.warning("lake compaction failed (%s); retried later", failure_reason(exc))

    def _scrape_loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            started = time.monotonic()
            try:
                self.scrape_all()
                self.read_gpu()
            except Exception:
                log.exception("scrape failed")
            stop.wait(max(0.0, self.scrape_interval - (time.monotonic() - started)))

    def backlog_bytes(self) -> int:
        """Bytes in the tailed files not read yet."""
        tailers = [s.tailer for s in self.logs] + [t for _n, t in self.event_files]
        return sum(t.lag_bytes() for t in tailers)

    def close(self) -> None:
        if self.lake is not None:
            self.lake.close()  # the last flush's events, written after its commit
        for source in self.logs:
            source.tailer.close()
        for _name, tailer in self.event_files:
            tailer.close()
