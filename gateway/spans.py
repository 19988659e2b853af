"""The gateway's span of one request, when tracing is on (`wire.tracing.tracer_from_env`).

The span is a child of the client's span (its `traceparent`), and the `traceparent` the gateway
sends upstream names the gateway's span, so vLLM's span becomes a child of ours: one trace from
the client through the gateway to the engine. The admission wait is a child span of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry.trace import Span, SpanKind, Tracer

from servescope.wire import tracing
from servescope.wire.stream import Endpoint


class RequestSpan:
    __slots__ = ("_tracer", "_span", "headers", "trace_id")

    def __init__(
        self, tracer: Tracer, request_headers: Mapping[str, str], endpoint: Endpoint, rid: str
    ) -> None:
        operation = "chat" if endpoint.chat else "text_completion"
        self._tracer = tracer
        self._span: Span
        self._span, self.headers = tracing.start_request_span(
            tracer,
            f"gateway {operation}",
            kind=SpanKind.SERVER,
            attributes=tracing.genai_attributes(operation, None, rid),
            parent_headers=request_headers,
        )  # `headers`: the traceparent of this span, for the upstream
        self.trace_id = tracing.trace_id_of(self._span)

    def admitted(self, model: str, team: str, queue_ms: float, since_ns: int) -> None:
        """The request got its slot: its model, and the admission wait since `since_ns`
        (`time.time_ns()`, the clock of spans)."""
        self._span.set_attribute("gen_ai.request.model", model)
        tracing.record_child_span(
            self._tracer,
            self._span,
            "gateway admission",
            since_ns,
            {"servescope.team": team, "servescope.queue_ms": queue_ms},
        )

    def end(self, event: Mapping[str, Any]) -> None:
        tracing.end_request_span(self._span, event)
