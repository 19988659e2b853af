"""A real OTLP/HTTP endpoint for tests: it decodes every protobuf export it receives.

It is the receiving half of the protocol (what an OpenTelemetry Collector does on :4318), built
from `opentelemetry-proto`'s own messages, so what tests read is what went over the wire.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def any_value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def attributes(items: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in items}


@dataclass
class Sink:
    url: str
    spans: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, list[Any]] = field(default_factory=dict)  # name -> Metric messages
    headers: list[dict[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_traces(self, request: ExportTraceServiceRequest, headers: dict[str, str]) -> None:
        with self.lock:
            self.headers.append(headers)
            for rs in request.resource_spans:
                resource = attributes(rs.resource.attributes)
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        self.spans.append(
                            {
                                "name": span.name,
                                "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(),
                                "parent_span_id": span.parent_span_id.hex(),
                                "kind": span.kind,
                                "start_ns": span.start_time_unix_nano,
                                "end_ns": span.end_time_unix_nano,
                                "status": span.status.code,
                                "attributes": attributes(span.attributes),
                                "resource": resource,
                            }
                        )

    def add_metrics(self, request: ExportMetricsServiceRequest, headers: dict[str, str]) -> None:
        with self.lock:
            self.headers.append(headers)
            for rm in request.resource_metrics:
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        self.metrics.setdefault(metric.name, []).append(metric)

    def wait_for(self, predicate: Callable[[Sink], bool], timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate(self):
            if time.monotonic() > deadline:
                raise AssertionError(f"the OTLP sink did not receive what was expected: {self}")
            time.sleep(0.05)


@contextmanager
def otlp_http_sink() -> Iterator[Sink]:
    """An OTLP/HTTP receiver on a free port of 127.0.0.1 (`POST /v1/traces`, `/v1/metrics`)."""
    sink = Sink(url="")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the http.server API
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            headers = {k.lower(): v for k, v in self.headers.items()}
            if self.path == "/v1/traces":
                sink.add_traces(ExportTraceServiceRequest.FromString(body), headers)
                answer = ExportTraceServiceResponse().SerializeToString()
            elif self.path == "/v1/metrics":
                sink.add_metrics(ExportMetricsServiceRequest.FromString(body), headers)
                answer = ExportMetricsServiceResponse().SerializeToString()
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    sink.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield sink
    finally:
        server.shutdown()
        server.server_close()
