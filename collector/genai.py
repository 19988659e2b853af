"""A stored request in the OpenTelemetry GenAI semantic conventions' words: its span attributes
(`gen_ai.*`, and `servescope.*` for what the conventions have no name for), vLLM's legacy
`llm_request` keys renamed, the GenAI metrics' histograms and their recommended buckets, and a
record's start time and trace id as the span wants them. Pure mapping: collector/otlp_export.py
does the exporting.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from opentelemetry.util.types import AttributeValue

PROVIDER = "vllm"

# Bucket boundaries recommended by the GenAI semantic conventions (the SDK sets none itself).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0]  # fmt: skip
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
DURATION_BUCKETS = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                    40.96, 81.92]  # fmt: skip
TOKEN_BUCKETS = [float(4**i) for i in range(14)]  # 1, 4, 16, …, 67108864
# The GenAI metrics: name → (unit, description, buckets).
HISTOGRAMS: dict[str, tuple[str, str, list[float]]] = {
    "gen_ai.server.time_to_first_token": (
        "s", "Time to generate the first token, for successful responses.", TTFT_BUCKETS,
    ),
    "gen_ai.server.time_per_output_token": (
        "s", "Time per output token after the first, for successful responses.", TPOT_BUCKETS,
    ),
    "gen_ai.server.request.duration": (
        "s", "Time from the request's start to its last token (or failure).", DURATION_BUCKETS,
    ),
    "gen_ai.client.token.usage": (
        "{token}", "Input and output tokens used per request.", TOKEN_BUCKETS,
    ),
}  # fmt: skip

# vLLM's legacy `llm_request` span keys → (current key, factor). Latencies are seconds there;
# servescope's phases are milliseconds like every time of the event.
LEGACY_KEYS: dict[str, tuple[str, float]] = {
    "gen_ai.usage.prompt_tokens": ("gen_ai.usage.input_tokens", 1),
    "gen_ai.usage.completion_tokens": ("gen_ai.usage.output_tokens", 1),
    "gen_ai.system": ("gen_ai.provider.name", 1),
    "gen_ai.latency.time_to_first_token": ("gen_ai.response.time_to_first_chunk", 1),
    "gen_ai.latency.e2e": ("servescope.e2e_ms", 1000),
    "gen_ai.latency.time_in_queue": ("servescope.queue_ms", 1000),
    "gen_ai.latency.time_in_model_prefill": ("servescope.prefill_ms", 1000),
    "gen_ai.latency.time_in_model_decode": ("servescope.decode_ms", 1000),
    "gen_ai.latency.time_in_model_inference": ("servescope.inference_ms", 1000),
    "gen_ai.latency.time_in_scheduler": ("servescope.scheduler_ms", 1000),
    "gen_ai.latency.time_in_model_forward": ("servescope.model_forward_ms", 1000),
    "gen_ai.latency.time_in_model_execute": ("servescope.model_execute_ms", 1000),
    "gen_ai.request.id": ("gen_ai.response.id", 1),
}


def current_attributes(attributes: Mapping[str, AttributeValue]) -> dict[str, AttributeValue]:
    """Rename vLLM's legacy GenAI keys to the current conventions (current keys win)."""
    out: dict[str, AttributeValue] = {}
    for key, value in attributes.items():
        if key in LEGACY_KEYS:
            new, factor = LEGACY_KEYS[key]
            if isinstance(value, int | float | str) and factor != 1:
                value = float(value) * factor
            out.setdefault(new, value)
        else:
            out[key] = value
    return out


def operation_of(doc: Mapping[str, Any]) -> str:
    """`chat` or `text_completion`: named by the record, else by its endpoint (default: text)."""
    if isinstance(doc.get("operation"), str):
        return str(doc["operation"])
    endpoint = str(doc.get("endpoint") or doc.get("path") or "")
    return "chat" if "chat" in endpoint else "text_completion"


def span_attributes(doc: Mapping[str, Any]) -> dict[str, AttributeValue]:
    """The span attributes of one stored request (None values left out)."""
    attrs: dict[str, AttributeValue | None] = {
        "gen_ai.operation.name": operation_of(doc),
        "gen_ai.provider.name": PROVIDER,
        "gen_ai.request.model": doc.get("model"),
        "gen_ai.usage.input_tokens": doc.get("prompt_tokens"),
        "gen_ai.usage.output_tokens": doc.get("completion_tokens"),
        "gen_ai.usage.cache_read.input_tokens": doc.get("cached_tokens"),
        "gen_ai.response.finish_reasons": [doc["finish_reason"]]
        if doc.get("finish_reason")
        else None,
        "gen_ai.response.time_to_first_chunk": seconds(doc.get("ttft_ms")),
        "error.type": error_type(doc),
        "servescope.request_id": doc.get("request_id"),
        "servescope.run_id": doc.get("run_id"),
        "servescope.source": doc.get("source"),
        "servescope.team": doc.get("team"),
        "servescope.workload": doc.get("workload"),
        "servescope.status": doc.get("status"),
        "servescope.ttft_ms": doc.get("ttft_ms"),
        "servescope.tpot_ms": doc.get("tpot_ms"),
        "servescope.e2e_ms": doc.get("e2e_ms"),
        "servescope.queue_ms": doc.get("queue_ms"),
        "servescope.prefill_ms": doc.get("prefill_ms"),
        "servescope.decode_ms": doc.get("decode_ms"),
        "http.response.status_code": doc.get("http_status"),
    }
    for key in ("max_tokens", "temperature", "top_p"):
        if isinstance(doc.get(key), int | float) and not isinstance(doc.get(key), bool):
            attrs[f"gen_ai.request.{key}"] = doc[key]
    # raw span attributes a record may carry (e.g. from vLLM's trace), legacy names mapped
    raw = {k: v for k, v in doc.items() if k.startswith("gen_ai.") and _is_attribute(v)}
    for key, value in current_attributes(raw).items():
        if attrs.get(key) is None:
            attrs[key] = value
    return {k: v for k, v in attrs.items() if v is not None}


def error_type(doc: Mapping[str, Any]) -> str | None:
    """The failure class (`timeout`, `http_5xx`, `rejected:queue_full`…), None for success."""
    status = doc.get("status")
    if status in (None, "ok") and not doc.get("error") and doc.get("finish_reason") != "error":
        return None
    return str(doc.get("error") or status or "error")


def seconds(ms: Any) -> float | None:
    """A record's milliseconds as seconds (None where it has no number)."""
    if isinstance(ms, int | float) and not isinstance(ms, bool):
        return float(ms) / 1000.0
    return None


def _is_attribute(value: Any) -> bool:
    if isinstance(value, str | bool | int | float):
        return True
    return isinstance(value, list) and all(isinstance(v, str | bool | int | float) for v in value)


def start_ns(doc: Mapping[str, Any]) -> int:
    """The request's start (its `ts`), else now less its e2e time, in Unix nanoseconds."""
    ts = doc.get("ts")
    if isinstance(ts, str):
        try:
            parsed = datetime.fromisoformat(ts)
        except ValueError:
            parsed = None
        if parsed is not None:
            if parsed.tzinfo is None:  # the store's timestamps are naive UTC
                parsed = parsed.replace(tzinfo=UTC)
            return int(parsed.timestamp() * 1e9)
    return time.time_ns() - int((seconds(doc.get("e2e_ms")) or 0.0) * 1e9)


def trace_id_of(doc: Mapping[str, Any]) -> int | None:
    """The record's W3C trace id as an int (None where it has none, or a malformed one)."""
    value = doc.get("trace_id")
    if isinstance(value, str) and len(value) == 32:
        try:
            trace_id = int(value, 16)
        except ValueError:
            return None
        return trace_id or None
    return None
