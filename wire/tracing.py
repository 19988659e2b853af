"""One trace per request: the client's span, and the `traceparent` that carries it upstream.

The load generator and the gateway start a span per request and send `traceparent` (W3C Trace
Context) to the next hop, so vLLM's `llm_request` span (vLLM started with
`--otlp-traces-endpoint`) is a child in the same trace, and the event keeps its `trace_id`.
Tracing is switched on the standard way: when `OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set (protocol, headers, service name and the rest from
the usual `OTEL_*` variables); otherwise there is no tracer and requests cost nothing extra. A
caller's own `traceparent` header is still honoured: the event then records that trace id.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

PROPAGATOR = TraceContextTextMapPropagator()
_PROVIDERS: dict[str, TracerProvider] = {}


def tracing_enabled() -> bool:
    return (
        bool(
            os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        )
        and os.environ.get("OTEL_SDK_DISABLED", "").lower() != "true"
    )


def tracer_from_env(service_name: str) -> Tracer | None:
    """An OTLP tracer for `service_name` when the environment asks for traces, else None.

    One provider per service per process, batched (the SDK's bounded queue), flushed at exit.
    """
    if not tracing_enabled():
        return None
    if service_name not in _PROVIDERS:
        protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
            "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
        )
        exporter: SpanExporter
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter as OTLPHttpSpanExporter,
            )

            exporter = OTLPHttpSpanExporter()
        resource = Resource.create({})
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": service_name}))
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(BatchSpanProcessor(exporter))
        _PROVIDERS[service_name] = provider
    return _PROVIDERS[service_name].get_tracer("servescope")


def trace_id_of(span: Span) -> str:
    return format(span.get_span_context().trace_id, "032x")


def trace_id_from_headers(headers: Mapping[str, str]) -> str | None:
    """The trace id of a `traceparent` header (`00-<trace id>-<span id>-<flags>`), if valid."""
    context = trace.get_current_span(PROPAGATOR.extract(dict(headers))).get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else None


def start_request_span(
    tracer: Tracer,
    name: str,
    *,
    kind: SpanKind,
    attributes: Mapping[str, AttributeValue],
    parent_headers: Mapping[str, str] | None = None,
    start_time: int | None = None,
) -> tuple[Span, dict[str, str]]:
    """A span for one request (child of `parent_headers`' traceparent, if any) and the headers
    that carry it to the next hop."""
    parent = PROPAGATOR.extract(dict(parent_headers)) if parent_headers else None
    span = tracer.start_span(
        name, context=parent, kind=kind, attributes=attributes, start_time=start_time
    )
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return span, carrier


def genai_attributes(operation: str, model: object, request_id: str) -> dict[str, AttributeValue]:
    """A request span's GenAI attributes (the model only when the request named one)."""
    attrs: dict[str, AttributeValue] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": "vllm",
        "servescope.request_id": request_id,
    }
    if isinstance(model, str):
        attrs["gen_ai.request.model"] = model
    return attrs


def end_request_span(span: Span, event: Mapping[str, Any]) -> None:
    """Close a request's span with what the event measured (GenAI names, times in seconds)."""
    values = {
        "gen_ai.usage.input_tokens": event.get("prompt_tokens"),
        "gen_ai.usage.output_tokens": event.get("completion_tokens"),
        "gen_ai.usage.cache_read.input_tokens": event.get("cached_tokens"),
        "gen_ai.response.time_to_first_chunk": (
            event["ttft_ms"] / 1000.0 if isinstance(event.get("ttft_ms"), int | float) else None
        ),
        "gen_ai.response.finish_reasons": (
            [event["finish_reason"]] if event.get("finish_reason") else None
        ),
        "http.response.status_code": event.get("http_status"),
        "servescope.queue_ms": event.get("queue_ms"),
        "servescope.team": event.get("team"),
    }
    for key, value in values.items():
        if value is not None:
            span.set_attribute(key, value)
    if event.get("status") not in (None, "ok"):
        kind = str(event.get("error") or event.get("status"))
        span.set_attribute("error.type", kind)
        span.set_status(Status(StatusCode.ERROR, kind))
    span.end()


def record_child_span(
    tracer: Tracer,
    parent: Span,
    name: str,
    start_time: int,
    attributes: Mapping[str, AttributeValue],
) -> None:
    """A finished phase of a request (e.g. the gateway's admission wait), ending now."""
    span = tracer.start_span(
        name,
        context=trace.set_span_in_context(parent),
        kind=SpanKind.INTERNAL,
        attributes=attributes,
        start_time=start_time,
    )
    span.end()
