"""An OTLP/HTTP trace receiver (`POST /v1/traces`, protobuf or JSON) for vLLM's
`--otlp-traces-endpoint`: every `llm_request` span becomes a piece of its request's event.

A request is answered only after the spans it carried are committed to the store, so an
exporter that got 200 can forget them: a crash before the commit makes it retry instead.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import re
import threading
import zlib
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from servescope.store import settings
from servescope.store.validation import InvalidEvent
from servescope.store.validation import decode as decode_json
from servescope.wire.ids import client_request_id

log = logging.getLogger("servescope.collector.otlp")

SOURCE = "vllm-trace"
MAX_BODY = 64 * 1024 * 1024
SPAN_NAME = "llm_request"
# span attribute (seconds) -> event key (milliseconds)
LATENCIES = {
    "gen_ai.latency.time_in_queue": "queue_ms",
    "gen_ai.latency.time_in_model_prefill": "prefill_ms",
    "gen_ai.latency.time_in_model_decode": "decode_ms",
    "gen_ai.latency.time_in_model_inference": "inference_ms",
    "gen_ai.latency.time_to_first_token": "server_ttft_ms",
    "gen_ai.latency.e2e": "server_e2e_ms",
}
COUNTS = {
    "gen_ai.usage.prompt_tokens": "prompt_tokens",
    "gen_ai.usage.input_tokens": "prompt_tokens",
    "gen_ai.usage.completion_tokens": "completion_tokens",
    "gen_ai.usage.output_tokens": "completion_tokens",
    "gen_ai.request.max_tokens": "max_tokens",
    "gen_ai.request.n": "n",
}
FLOATS = {"gen_ai.request.temperature": "temperature", "gen_ai.request.top_p": "top_p"}
_SPAN_ID = re.compile(r"^[0-9a-fA-F]{16}$")


class BadPayload(ValueError):
    """The body is not an OTLP trace export; the message says why."""


class Span(NamedTuple):
    """A span as either encoding gives it: the attributes as decoded, not yet checked."""

    name: str
    trace_id: str  # hex
    start_ns: int  # Unix nanoseconds
    attributes: dict[str, object]
    span_id: str  # hex; "" when the export has none


def decode(body: bytes, content_type: str, encoding: str | None) -> list[Span]:
    """The spans of one export request, either encoding."""
    if encoding in ("gzip", "deflate"):
        try:
            body = gzip.decompress(body) if encoding == "gzip" else zlib.decompress(body)
        except (OSError, EOFError, zlib.error) as exc:
            raise BadPayload(f"bad {encoding} body: {exc}") from None
    if "json" in content_type:
        return _decode_json(body)
    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(body)
    except Exception as exc:  # noqa: BLE001 - protobuf's backends (upb, C++, Python) raise different classes on garbage; every one is a 400
        raise BadPayload(f"not an OTLP protobuf trace export: {exc}") from None
    spans = []
    for rs in request.resource_spans:
        for ss in rs.scope_spans:
            for span in ss.spans:
                attrs = {kv.key: _any_value(kv.value) for kv in span.attributes}
                spans.append(
                    Span(
                        span.name,
                        span.trace_id.hex(),
                        span.start_time_unix_nano,
                        attrs,
                        span.span_id.hex(),
                    )
                )
    return spans


def _any_value(value: AnyValue) -> object:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


def _decode_json(body: bytes) -> list[Span]:
    try:
        doc = decode_json(body, max_bytes=MAX_BODY)  # the store's rules: strict, bounded depth
    except InvalidEvent as exc:
        raise BadPayload(str(exc)) from None
    spans = []
    try:
        for rs in doc.get("resourceSpans") or []:
            for ss in rs.get("scopeSpans") or []:
                for span in ss.get("spans") or []:
                    attrs = {
                        a["key"]: _json_value(a.get("value") or {})
                        for a in span.get("attributes") or []
                    }
                    start = int(span.get("startTimeUnixNano") or 0)
                    spans.append(
                        Span(
                            str(span.get("name", "")),
                            str(span.get("traceId", "")),
                            start,
                            attrs,
                            str(span.get("spanId") or ""),
                        )
                    )
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise BadPayload(f"not an OTLP JSON trace export: {exc!r}") from None
    return spans


def _json_value(value: Mapping[str, Any]) -> object:
    for kind in ("stringValue", "boolValue", "doubleValue"):
        if kind in value:
            return value[kind]
    if "intValue" in value:
        return int(value["intValue"])  # int64 travels as a string in OTLP JSON
    return None


def span_piece(span: Span) -> dict[str, object] | None:
    """An `llm_request` span as a piece of its request's event (None for other spans).

    Raises BadPayload when an `llm_request` span lacks its request id or has wrong types.

    The piece names its part of the request (`vllm_part`: `<vLLM id>#<span id>`): a call with
    `n` > 1 is sampled by child requests whose spans all carry the parent's `gen_ai.request.id`
    (and `gen_ai.request.n` 1), often the same timings too (children decode in the same engine
    steps), so the span id is what tells one sample's span from another's, and a span exported
    twice from itself; the vLLM id (`cmpl-R-<i>`) tells the prompts of a completions call with
    a list of prompts apart. The store keeps each part's figures and sums them up for the
    request (`store.merge_docs`).
    """
    name, trace_id, start_ns, attrs, span_id = span
    if name != SPAN_NAME:
        return None
    vllm_id = attrs.get("gen_ai.request.id")
    if not isinstance(vllm_id, str) or not client_request_id(vllm_id):
        raise BadPayload("llm_request span without gen_ai.request.id")
    request_id = client_request_id(vllm_id)
    doc: dict[str, object] = {"request_id": request_id, "source": SOURCE}
    if 0 < start_ns < 2**63:  # a time a datetime holds (the field is a fixed64)
        doc["server_ts"] = datetime.fromtimestamp(start_ns / 1e9, UTC).isoformat()
    if trace_id and trace_id.strip("0"):
        doc["trace_id"] = trace_id
    doc["vllm_request_id"] = vllm_id
    if _SPAN_ID.match(span_id) and span_id.strip("0"):
        doc["vllm_part"] = f"{vllm_id}#{span_id.lower()}"
    doc.update(_figures(attrs))
    return doc


def _figures(attrs: Mapping[str, object]) -> dict[str, float | int]:
    """The span's latencies (s → ms), counts and sampling floats under the event's keys;
    BadPayload for a latency or count of the wrong type or out of range."""
    out: dict[str, float | int] = {}
    for attr, key in LATENCIES.items():
        value = attrs.get(attr)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise BadPayload(f"{attr} is not a number")
        if not math.isfinite(value) or value < 0:
            raise BadPayload(f"{attr} is {value}: a duration must be finite and >= 0")
        out[key] = round(float(value) * 1000.0, 3)
    for attr, key in COUNTS.items():
        value = attrs.get(attr)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadPayload(f"{attr} is not an integer")
        if not 0 <= value <= 2**31 - 1:
            raise BadPayload(f"{attr} is {value}: a count must be in 0..2**31-1")
        out[key] = value
    for attr, key in FLOATS.items():
        value = attrs.get(attr)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            out[key] = float(value)
    return out


# (candidate pieces, refusals) -> an event set once they are committed
Submit = Callable[[list[dict[str, object]], list[tuple[str, str]]], threading.Event]


class OtlpReceiver:
    """Serves `/v1/traces` in a background thread; hands pieces and refusals to `submit`, which
    returns an event set once they are committed."""

    def __init__(
        self, submit: Submit, host: str = settings.HOST, port: int = settings.OTLP_PORT
    ) -> None:
        self.submit = submit
        self.spans = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                receiver._handle(self)

            def log_message(self, _format: str, *_args: Any) -> None:
                return

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> OtlpReceiver:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handle(self, http: BaseHTTPRequestHandler) -> None:
        try:
            self._serve(http)
        except Exception as exc:  # noqa: BLE001 - never a traceback on the console, whatever a client sends
            log.error("OTLP request from %s failed: %r", http.client_address[0], exc)
            http.close_connection = True

    def _serve(self, http: BaseHTTPRequestHandler) -> None:
        if http.path.split("?")[0] != "/v1/traces":
            _reply(http, 404, b"only /v1/traces", "text/plain")
            return
        try:
            length = int(http.headers.get("Content-Length") or 0)
        except ValueError:
            length = 0
        if length <= 0 or length > MAX_BODY:
            _reply(http, 413 if length > MAX_BODY else 400, b"bad Content-Length", "text/plain")
            return
        body = http.rfile.read(length)
        content_type = http.headers.get("Content-Type") or "application/x-protobuf"
        pieces: list[dict[str, object]] = []
        refused: list[tuple[str, str]] = []
        try:
            spans = decode(body, content_type, http.headers.get("Content-Encoding"))
        except BadPayload as exc:
            refused.append((str(exc), body[:4096].hex()))
            spans = []
        for span in spans:
            try:
                piece = span_piece(span)
            except BadPayload as exc:
                refused.append((str(exc), json.dumps(span.attributes, default=str)[:4096]))
                continue
            if piece is not None:
                pieces.append(piece)
        self.spans += len(spans)
        done = self.submit(pieces, refused)
        if not done.wait(timeout=30):
            _reply(http, 503, b"not committed yet; retry", "text/plain")
            return
        if refused and not pieces and not spans:
            _reply(http, 400, refused[0][0].encode(), "text/plain")
            return
        if "json" in content_type:
            _reply(http, 200, b"{}", "application/json")
        else:
            _reply(
                http,
                200,
                ExportTraceServiceResponse().SerializeToString(),
                "application/x-protobuf",
            )


def _reply(http: BaseHTTPRequestHandler, status: int, body: bytes, content_type: str) -> None:
    http.send_response(status)
    http.send_header("Content-Type", content_type)
    http.send_header("Content-Length", str(len(body)))
    http.end_headers()
    http.wfile.write(body)
