"""A vLLM server log (text or JSON lines, `--enable-log-requests`), tailed and parsed line by
line (wire/vllm_log.py) into request pieces, samples (the periodic stats line, the KV-cache
statement, HTTP responses by status) and the server sessions the log holds (collector/
sessions.py), whose state is checkpointed with the offsets so a restart resumes mid-session."""

from __future__ import annotations

import time
from collections import Counter
from datetime import UTC, datetime
from typing import Any, cast

from servescope.collector.attribution import ServerLog, parse_ts
from servescope.collector.batch import Batch
from servescope.collector.sessions import Session
from servescope.collector.sources.tailed import Tailed
from servescope.collector.tail import Chunk
from servescope.store import InvalidEvent, check_built, checkpoints
from servescope.store.clock import naive_utc, utcnow
from servescope.store.validation import EventDoc
from servescope.wire import container_log, vllm_log
from servescope.wire.ids import UNATTRIBUTED_RUN

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


def _checked(piece: vllm_log.Piece) -> vllm_log.Piece | vllm_log.Bad:
    """A piece of a request as the store's rules take it, or the reason they refuse it."""
    try:
        check_built(piece.doc)
    except InvalidEvent as exc:
        return vllm_log.Bad(str(exc))
    return piece


def _later(written: datetime | None, session: Session | None) -> str | None:
    """An undated line's time: when it was read live, never before the server's last dated
    line; else that line's time."""
    last = session.last_ts if session is not None else None
    if written is None:
        return last
    floor = parse_ts(last)
    return (max(written, floor) if floor is not None else written).isoformat()


def _read_before(chunk: Chunk, size: int) -> tuple[bytes, bool]:
    """Up to `size` bytes of the chunk's file just before it, and whether they start the file
    (the tailer seeks before every read of its own)."""
    assert chunk.file.fh is not None
    start = max(0, chunk.start - size)
    chunk.file.fh.seek(start)
    return chunk.file.fh.read(chunk.start - start), start == 0


class VllmLog(Tailed):
    """One vLLM log file (rotated copies followed) and the server sessions it holds."""

    kind = "vllm-log"
    server: ServerLog  # the server lifetimes the log holds, as far as it was read

    def __init__(self, path: str) -> None:
        super().__init__(path)
        # Wall time of the last poll that read the log to its end (None: not caught up, or once)
        self.caught_up: float | None = None
        self._written: datetime | None = None
        # CRI and Docker json-file records to vLLM's lines, by file (a split line may span chunks)
        self._unwrap: dict[str, container_log.Unwrapper] = {}
        self._resumed: set[str] = set()  # files read again before their checkpoint, once

    def resume(self, saved: list[dict[str, Any]]) -> None:
        self.server = self.intake.attribution.follow_log(self.name, checkpoints.state_of(saved))
        super().resume(saved)

    def poll(self) -> int:
        """Read the log's new lines. When the last poll had read it to the end, what this one
        finds was written since: now dates its undated lines (uvicorn's access lines), within a
        poll interval; a backlog or `--once` has no such bound."""
        live = self.caught_up is not None and not self.intake.once
        self._written = datetime.now(UTC) if live else None
        read = super().poll()
        self.caught_up = time.time() if self.tailer.lag_bytes() == 0 else None
        return read

    def take(self, batch: Batch, chunk: Chunk) -> None:
        offset = chunk.start
        lines = chunk.data.split(b"\n")
        if chunk.data.endswith(b"\n"):
            lines.pop()
        server = self.server
        before = server.snapshot()
        access: Counter[tuple[str, str, str]] = Counter()
        unwrap = self._unwrapper(chunk)
        for line in lines:
            here, offset = offset, offset + len(line) + 1
            if not line.strip():
                continue
            record = unwrap.feed(line)  # a container runtime's record, or a plain line
            if record is None:
                continue  # a line the runtime split: it is read whole with its final record
            batch.lines[self.name] += 1
            if record.too_long:
                reason = f"line too long ({record.too_long} bytes)"
                batch.errors.append((chunk.file.error_source, here, reason, record.text))
                continue
            year = record.ts.astimezone().year if record.ts else chunk.year
            item = container_log.dated(vllm_log.parse_line(record.text, year=year), record.ts)
            if isinstance(item, vllm_log.Access):
                access[(item.method, item.path, str(item.status))] += 1
                if item.status >= 400 and item.path.split("?", 1)[0] in INFERENCE_PATHS:
                    self._refused(batch, item, chunk, here)
            elif item is not None:
                self._item(batch, item, (chunk.file.error_source, here, record.text))
        if not unwrap.pending:
            del self._unwrap[chunk.file.key]
        self._access_samples(batch, access)
        state = server.changed_state(before)
        if state is not None:
            batch.checkpoint_state(self.name, state)

    def _unwrapper(self, chunk: Chunk) -> container_log.Unwrapper:
        """The container-log reader of the chunk's file: kept while a split line is pending;
        a new one after a restart reads the bytes before the chunk first."""
        unwrap = self._unwrap.get(chunk.file.key)
        if unwrap is None:
            unwrap = self._unwrap[chunk.file.key] = container_log.Unwrapper(self.tailer.max_line)
            if chunk.start and chunk.file.key not in self._resumed:  # a restart: read on
                read, whole = _read_before(chunk, unwrap.lookback)
                unwrap.resume(read, whole=whole)
        self._resumed.add(chunk.file.key)
        return unwrap

    def _item(
        self,
        batch: Batch,
        item: vllm_log.Piece
        | vllm_log.Bad
        | vllm_log.Stats
        | vllm_log.Levers
        | vllm_log.KvCache
        | vllm_log.Startup
        | vllm_log.Phase
        | vllm_log.Tick,
        where: tuple[str, int, bytes],
    ) -> None:
        """A parsed line other than an access line: a request's piece (checked by the store's
        rules), a refused line (`where` it was: source, offset, text), or a server line."""
        if isinstance(item, vllm_log.Piece):
            item = _checked(item)
        if isinstance(item, vllm_log.Piece):
            self.server.seen(parse_ts(item.doc.get("log_ts")))
            # a piece `_checked` let through: the store's rules hold for it
            batch.docs.append(self.server.attribute(cast(EventDoc, item.doc)))
        elif isinstance(item, vllm_log.Bad):
            source, offset, text = where
            batch.errors.append((source, offset, item.reason, text))
        else:
            self._server_line(batch, item)

    def _access_samples(self, batch: Batch, access: Counter[tuple[str, str, str]]) -> None:
        """The chunk's access lines counted by method, path and status, as samples."""
        now = utcnow()
        for (method, path, status), n in access.items():
            labels = {"method": method, "path": path, "status": status}
            batch.samples.append(
                (now, self.name, "vllm_log:http_responses", labels, self.server.run_id, float(n))
            )

    def _server_line(
        self,
        batch: Batch,
        item: vllm_log.Stats
        | vllm_log.Levers
        | vllm_log.KvCache
        | vllm_log.Startup
        | vllm_log.Phase
        | vllm_log.Tick,
    ) -> None:
        """A line about the server rather than a request: its session's life, configuration
        and start-up, and the engine's periodic stats."""
        server = self.server
        if isinstance(item, vllm_log.Tick):
            server.seen(item.ts)
        elif isinstance(item, vllm_log.Stats):
            server.seen(item.ts)
            ts = naive_utc(item.ts) if item.ts else utcnow()
            run = server.run_id
            for key, value in item.values.items():
                batch.samples.append(
                    (ts, self.name, f"vllm_log:{key}", {"engine": item.engine}, run, value)
                )
        elif isinstance(item, vllm_log.Startup):
            server.startup(item)
        elif isinstance(item, vllm_log.Levers):
            server.configure(item)
        elif isinstance(item, vllm_log.KvCache):
            server.kv_cache(item)
            self._kv_samples(batch, item)
        elif isinstance(item, vllm_log.Phase):
            server.phase(item)

    def _kv_samples(self, batch: Batch, item: vllm_log.KvCache) -> None:
        """vLLM's start-up KV-cache statement as samples `vllm_log:kv_cache_tokens{device}` and
        `vllm_log:max_concurrency{max_model_len}` of the session's run; each data-parallel
        engine's with its `engine` label, as vLLM labels its `/metrics`."""
        ts = naive_utc(item.ts) if item.ts else utcnow()
        run = self.server.run_id
        engine = {"engine": item.engine} if item.engine is not None else {}
        if "kv_cache_tokens" in item.values:
            device = {"device": str(item.values.get("kv_cache_device", "")), **engine}
            value = float(item.values["kv_cache_tokens"])
            batch.samples.append((ts, self.name, "vllm_log:kv_cache_tokens", device, run, value))
        if "max_concurrency" in item.values:
            labels = {"max_model_len": str(item.values["max_model_len"]), **engine}
            value = float(item.values["max_concurrency"])
            batch.samples.append((ts, self.name, "vllm_log:max_concurrency", labels, run, value))

    def _refused(self, batch: Batch, item: vllm_log.Access, chunk: Chunk, offset: int) -> None:
        """An access line answering an inference request with 4xx/5xx: vLLM refused or failed
        a request it logged no id for, and a request that failed still counts. Its id is its
        place in the log file, so reading the line again gives the same event. A text access
        line has no time: it is dated when it was read live, else at the server's last dated
        line (its lower bound: a backlog or `--once`)."""
        server = self.server
        if item.status == 429:
            status, error = "rejected", "rejected:http_429"
        else:
            status, error = "error", f"http_{item.status // 100}xx"
        ts = item.ts.isoformat() if item.ts else _later(self._written, server.session)
        doc: dict[str, object] = {
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
        # the event's keys are the contract's, of its types (`status` one of its classes)
        piece = cast(EventDoc, {k: v for k, v in doc.items() if v is not None})
        batch.docs.append(server.attribute(piece))
