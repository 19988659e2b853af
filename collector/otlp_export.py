"""Forward stored requests to any OTLP backend: one span per request, plus the GenAI metrics.

Names follow the OpenTelemetry GenAI semantic conventions (span `{operation} {model}`,
`gen_ai.operation.name`, `gen_ai.provider.name = vllm`, `gen_ai.usage.*`, `error.type`…; metrics
`gen_ai.server.time_to_first_token`, `gen_ai.server.time_per_output_token`,
`gen_ai.server.request.duration`, `gen_ai.client.token.usage` with the bucket boundaries the
conventions recommend). What the conventions have no name for is under `servescope.*`
(queue/prefill/decode phases, team, run). vLLM's legacy span keys (`gen_ai.usage.prompt_tokens`,
`gen_ai.latency.*`, `gen_ai.system`) are mapped to the current ones by `current_attributes`.

Ingestion never waits for the backend: `submit` puts records on a bounded queue and returns; one
worker thread turns them into spans and exports them in batches with the SDK's OTLP exporters
(HTTP or gRPC; each export retried with exponential backoff by the exporter, up to its timeout).
Until the endpoint has taken an export (at start, after a failure), a batch is led by a one-span
probe and the rest is converted only if the probe gets through: an endpoint that is down costs
one converted span per retry, not a batch of work taken from ingestion.
A full queue or a batch the backend never took is dropped and counted in
`servescope_collector_export_dropped_total{reason}`, so memory stays bounded whatever the
endpoint does. Standard `OTEL_*` variables are honoured: `OTEL_EXPORTER_OTLP_ENDPOINT` (and the
`_TRACES_`/`_METRICS_` variants) when no URL is given, `OTEL_EXPORTER_OTLP_PROTOCOL`,
`_HEADERS`, `_TIMEOUT`, `_COMPRESSION`, `_CERTIFICATE`, `OTEL_SERVICE_NAME`,
`OTEL_RESOURCE_ATTRIBUTES`.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any, cast
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue
from prometheus_client import REGISTRY, CollectorRegistry, Counter

from servescope.collector.genai import (
    HISTOGRAMS,
    operation_of,
    seconds,
    span_attributes,
    start_ns,
    trace_id_of,
)
from servescope.store import reads
from servescope.store.validation import EventDoc, is_runtime_event

log = logging.getLogger(__name__)

SERVICE_NAME = "servescope-collector"
HTTP = "http/protobuf"
GRPC = "grpc"

# by the registry itself, weakly: keyed by id(), a new registry that reused a dead one's id got
# counters registered on the dead one, and its own samples stayed empty
_COUNTERS: weakref.WeakKeyDictionary[CollectorRegistry, tuple[Counter, Counter]] = (
    weakref.WeakKeyDictionary()
)
_COUNTERS_LOCK = threading.Lock()


def export_counters(registry: CollectorRegistry = REGISTRY) -> tuple[Counter, Counter]:
    """(dropped, exported) span counters, created once per registry."""
    with _COUNTERS_LOCK:
        if registry not in _COUNTERS:
            _COUNTERS[registry] = (
                Counter(
                    "servescope_collector_export_dropped",
                    "Spans not delivered to the OTLP endpoint: queue_full (the endpoint is "
                    "slower than ingestion) or export_failed (retries exhausted).",
                    ["reason"],
                    registry=registry,
                ),
                Counter(
                    "servescope_collector_export_spans",
                    "Spans the OTLP endpoint accepted.",
                    registry=registry,
                ),
            )
        return _COUNTERS[registry]


class _RecordIds(IdGenerator):
    """Span ids at random; the trace id of the record being converted, so its span joins the
    trace the client, the gateway and vLLM share (random when the record has none)."""

    def __init__(self) -> None:
        self._random = RandomIdGenerator()
        self.next_trace_id: int | None = None

    def generate_span_id(self) -> int:
        return self._random.generate_span_id()

    def generate_trace_id(self) -> int:
        trace_id, self.next_trace_id = self.next_trace_id, None
        return trace_id or self._random.generate_trace_id()


class _Collect(SpanProcessor):
    """Keeps the spans the worker just ended, for it to export as one batch."""

    def __init__(self) -> None:
        self.ended: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.ended.append(span)


def exporters(
    url: str | None, protocol: str | None = None
) -> tuple[SpanExporter, Any]:  # (span exporter, metric exporter)
    """The SDK's OTLP exporters for `url` (a collector's base URL) and protocol.

    HTTP posts to URL/v1/traces and URL/v1/metrics; gRPC talks to URL as is. Without a URL the
    exporters read `OTEL_EXPORTER_OTLP_*` themselves.
    """
    protocol = (
        protocol
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or HTTP
    )
    if protocol == GRPC:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
            OTLPMetricExporter as GrpcMetrics,
        )
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcSpans,
        )

        insecure = None if url is None else urlsplit(url).scheme == "http"
        return GrpcSpans(endpoint=url, insecure=insecure), GrpcMetrics(
            endpoint=url, insecure=insecure
        )
    if protocol != HTTP:
        raise ValueError(f"unsupported OTLP protocol {protocol!r} (use {HTTP!r} or {GRPC!r})")
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
        OTLPMetricExporter as HttpMetrics,
    )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpSpans,
    )

    if url is None:
        return HttpSpans(), HttpMetrics()
    base = url.rstrip("/").removesuffix("/v1/traces").removesuffix("/v1/metrics")
    return HttpSpans(endpoint=f"{base}/v1/traces"), HttpMetrics(endpoint=f"{base}/v1/metrics")


class OtlpExport:
    """A bounded, batched, retrying OTLP forwarder for stored request records.

    `submit(records)` never blocks; `flush()` waits (bounded) until everything submitted was
    exported or dropped; `shutdown()` flushes and stops the worker and the metric reader.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        protocol: str | None = None,
        max_queue: int = 4096,
        batch_size: int = 512,
        schedule_delay_s: float = 1.0,
        metric_interval_s: float = 10.0,
        registry: CollectorRegistry = REGISTRY,
        span_exporter: SpanExporter | None = None,
        metric_exporter: Any = None,
    ) -> None:
        if span_exporter is None or metric_exporter is None:
            default_spans, default_metrics = exporters(url, protocol)
            span_exporter = span_exporter or default_spans
            metric_exporter = metric_exporter or default_metrics
        self.url = url
        self._exporter = span_exporter
        self._queue: queue.Queue[EventDoc] = queue.Queue(maxsize=max_queue)
        self._batch_size = batch_size
        self._delay = schedule_delay_s
        self._registry = registry
        self._dropped, self._exported = export_counters(registry)
        self._pending = 0  # submitted, not yet exported or dropped
        self._pending_lock = threading.Condition()
        self._stop = threading.Event()

        resource = Resource.create({})  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
        self._ids = _RecordIds()
        self._ended = _Collect()
        self._tracer_provider = TracerProvider(resource=resource, id_generator=self._ids)
        self._tracer_provider.add_span_processor(self._ended)
        self._tracer = self._tracer_provider.get_tracer("servescope.collector")
        self._reader = PeriodicExportingMetricReader(
            metric_exporter, export_interval_millis=metric_interval_s * 1000
        )
        self._meter_provider = MeterProvider(resource=resource, metric_readers=[self._reader])
        meter = self._meter_provider.get_meter("servescope.collector")
        self._ttft, self._tpot, self._duration, self._tokens = (
            meter.create_histogram(
                name, unit=unit, description=text, explicit_bucket_boundaries_advisory=buckets
            )
            for name, (unit, text, buckets) in HISTOGRAMS.items()
        )
        self._worker = threading.Thread(target=self._run, name="otlp-export", daemon=True)
        self._worker.start()

    # -- the ingestion side: never blocks ----------------------------------------------------

    def submit(self, records: Iterable[Mapping[str, Any]]) -> int:
        """Queue request records for export; returns how many were dropped (queue full)."""
        dropped = 0
        for record in records:
            if "request_id" not in record or is_runtime_event(record):
                continue  # agent-runtime events are not requests
            with self._pending_lock:
                self._pending += 1
            try:
                # a stored request's record: the store kept it by its rules
                self._queue.put_nowait(cast(EventDoc, dict(record)))
            except queue.Full:
                dropped += 1
                self._settle(1)
        if dropped:
            self._dropped.labels(reason="queue_full").inc(dropped)
        return dropped

    def count_dropped(self, n: int, reason: str) -> None:
        """Count spans lost before they reached this exporter (`queue_full`/`export_failed`)."""
        self._dropped.labels(reason=reason).inc(n)

    def dropped(self) -> float:
        """Spans dropped so far (all exporters sharing this registry)."""
        return sum(
            self._registry.get_sample_value(
                "servescope_collector_export_dropped_total", {"reason": reason}
            )
            or 0.0
            for reason in ("queue_full", "export_failed")
        )

    def exported(self) -> float:
        """Spans the endpoint accepted so far (all exporters sharing this registry)."""
        return self._registry.get_sample_value("servescope_collector_export_spans_total") or 0.0

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every submitted record was exported or dropped; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._pending_lock:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._pending_lock.wait(left)
        return self._meter_provider.force_flush(int(max(deadline - time.monotonic(), 1) * 1000))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Deliver what is queued within `timeout_s` in all (a container's stop grace period is
        short); what is left is counted as dropped, never waited for."""
        deadline = time.monotonic() + timeout_s

        def left() -> float:
            return max(deadline - time.monotonic(), 0.1)

        self.flush(left())
        self._stop.set()
        self._worker.join(left())
        lost = 0  # still queued: never sent (a batch in the worker's hands counts itself)
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
            lost += 1
        if lost:
            self.count_dropped(lost, "export_failed")
            self._settle(lost)
        self._meter_provider.shutdown(timeout_millis=int(left() * 1000))
        self._exporter.shutdown()

    # -- the worker ----------------------------------------------------------------------------

    def _settle(self, n: int) -> None:
        with self._pending_lock:
            self._pending -= n
            self._pending_lock.notify_all()

    def _run(self) -> None:
        backoff = 0.0
        healthy = False  # until the endpoint takes an export, a batch is led by a one-span probe
        while not self._stop.is_set():
            batch = self._take()
            if not batch:
                continue
            parts = [batch] if healthy else [batch[:1], batch[1:]]
            delivered = 0
            try:
                for part in parts:
                    if part and not self._send(part):
                        break
                    delivered += len(part)
            except Exception:  # noqa: BLE001 - a bad record or exporter bug must not kill export
                log.exception("OTLP export of %d spans failed", len(batch) - delivered)
            healthy = delivered == len(batch)
            if delivered:
                self._exported.inc(delivered)
            if healthy:
                backoff = 0.0
            else:
                self._dropped.labels(reason="export_failed").inc(len(batch) - delivered)
                # the exporter retried already; pause before the next batch, longer each time
                backoff = min(max(backoff * 2, 0.5), 30.0)
            self._settle(len(batch))
            if backoff:
                self._stop.wait(backoff * random.uniform(0.8, 1.2))

    def _send(self, records: list[EventDoc]) -> bool:
        spans = [self._convert(record) for record in records]
        return self._exporter.export(spans) == SpanExportResult.SUCCESS

    def _take(self) -> list[EventDoc]:
        batch: list[EventDoc] = []
        deadline = time.monotonic() + self._delay
        while len(batch) < self._batch_size:
            left = deadline - time.monotonic()
            try:
                item = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            batch.append(item)
        return batch

    def _convert(self, doc: EventDoc) -> ReadableSpan:
        attrs = span_attributes(doc)
        start = start_ns(doc)
        e2e = seconds(doc.get("e2e_ms")) or 0.0
        self._ids.next_trace_id = trace_id_of(doc)
        operation = operation_of(doc)
        name = f"{operation} {doc['model']}" if doc.get("model") else operation
        span = self._tracer.start_span(
            name,
            context=trace.set_span_in_context(trace.INVALID_SPAN),
            kind=SpanKind.CLIENT,
            attributes=attrs,
            start_time=start,
        )
        failure = attrs.get("error.type")
        if failure:
            span.set_status(Status(StatusCode.ERROR, str(failure)))
        span.end(end_time=start + int(e2e * 1e9))
        self._record_metrics(doc, attrs, e2e)
        return self._ended.ended.pop()

    def _record_metrics(self, doc: EventDoc, attrs: dict[str, AttributeValue], e2e: float) -> None:
        common: dict[str, AttributeValue] = {
            k: attrs[k]
            for k in ("gen_ai.operation.name", "gen_ai.provider.name", "gen_ai.request.model")
            if k in attrs
        }
        failed = "error.type" in attrs
        outcome = {"error.type": attrs["error.type"]} if failed else {}
        self._duration.record(e2e, {**common, **outcome})
        if not failed:
            if (ttft := seconds(doc.get("ttft_ms"))) is not None:
                self._ttft.record(ttft, common)
            if (tpot := seconds(doc.get("tpot_ms"))) is not None:
                self._tpot.record(tpot, common)
        for key, kind in (("prompt_tokens", "input"), ("completion_tokens", "output")):
            value = doc.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                self._tokens.record(value, {**common, "gen_ai.token.type": kind})


class StoredRequestForwarder:
    """The collector's exporter hook: forwards each stored request once its pieces settled.

    A request arrives in pieces (the client's event, vLLM's trace, log lines), often in
    different flushes. Each flush reports the keys it wrote; a key is forwarded `settle_s` after
    the last piece touched it, read back merged from the store, so a request becomes one span
    with every piece in it. Keys wait in a bounded map (overflow is dropped and counted); the
    store is read by this forwarder's own thread, beside the collector's writes.
    """

    def __init__(
        self,
        store: Any,
        export: OtlpExport,
        *,
        settle_s: float = 5.0,
        max_pending: int = 65536,
        poll_s: float = 0.5,
    ) -> None:
        self.store = store
        self.export = export
        self.settle_s = settle_s
        self.max_pending = max_pending
        self._pending: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._poll_s = poll_s
        self._thread = threading.Thread(target=self._run, name="otlp-forward", daemon=True)
        self._thread.start()

    def __call__(self, report: Any) -> None:
        """Called by `Collector.flush` with what it committed (`report.keys`)."""
        due = time.monotonic() + self.settle_s
        overflow = 0
        with self._lock:
            for key in report.keys:
                self._pending[key] = due
                self._pending.move_to_end(key)
            while len(self._pending) > self.max_pending:
                self._pending.popitem(last=False)
                overflow += 1
        if overflow:
            self.export.count_dropped(overflow, "queue_full")

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def _due(self, everything: bool = False, limit: int = 2048) -> list[tuple[str, str]]:
        now = time.monotonic()
        keys: list[tuple[str, str]] = []
        with self._lock:
            for key, due in self._pending.items():
                if len(keys) >= limit or (due > now and not everything):
                    break  # insertion order is deadline order
                keys.append(key)
            for key in keys:
                del self._pending[key]
        return keys

    def _forward(self, keys: list[tuple[str, str]]) -> None:
        # a read-write connection: in this process the collector may hold the file for writing,
        # and DuckDB shares one instance between connections of the same configuration
        with self.store.write() as con:
            docs = reads.events_by_keys(con, keys)
        self.export.submit(docs)

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            keys = self._due()
            while keys:
                try:
                    self._forward(keys)
                except Exception:  # noqa: BLE001 - the store busy or gone: count, keep going
                    log.exception("reading %d settled requests for OTLP export failed", len(keys))
                    self.export.count_dropped(len(keys), "export_failed")
                keys = self._due()

    def close(self, timeout_s: float = 5.0) -> None:
        """Forward everything still waiting (settled or not), then flush and stop the export."""
        self._stop.set()
        self._thread.join(timeout_s)
        while keys := self._due(everything=True):
            try:
                self._forward(keys)
            except Exception:  # noqa: BLE001
                log.exception("reading %d requests for OTLP export failed", len(keys))
                self.export.count_dropped(len(keys), "export_failed")
        self.export.shutdown(timeout_s)
