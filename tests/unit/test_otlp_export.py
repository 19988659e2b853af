"""OTLP export: the SDK's real exporters send stored requests to an OTLP endpoint started here;
the decoded protobuf carries the GenAI names and the stored values. With the endpoint down,
`submit` still returns at once and the drop counter rises."""

from __future__ import annotations

from concurrent import futures
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client import CollectorRegistry, generate_latest

from servescope.collector.genai import (
    DURATION_BUCKETS,
    TOKEN_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
    current_attributes,
)
from servescope.collector.otlp_export import OtlpExport, StoredRequestForwarder
from servescope.store import Store
from tests.helpers.otlp_records import RECORDS, RUN, TRACE, stored_records
from tests.helpers.otlp_sink import otlp_http_sink


def bounds(metric: Any) -> list[float]:
    return list(metric.histogram.data_points[0].explicit_bounds)


def test_stored_requests_arrive_as_genai_spans_and_metrics_over_http(tmp_path: Path) -> None:
    records = stored_records(tmp_path)
    registry = CollectorRegistry()
    with otlp_http_sink() as sink:
        export = OtlpExport(sink.url, registry=registry, schedule_delay_s=0.05)
        assert export.submit(records) == 0
        assert export.flush(30)
        export.shutdown()
        sink.wait_for(lambda s: len(s.spans) == 2 and "gen_ai.client.token.usage" in s.metrics)

    spans = {s["attributes"]["servescope.request_id"]: s for s in sink.spans}
    check_the_answered_span(spans[f"{RUN}-000001"])
    check_the_rejected_span(spans[f"{RUN}-000002"])
    check_the_genai_metrics(sink.metrics)
    assert "servescope_collector_export_spans_total 2.0" in generate_latest(registry).decode()


def check_the_answered_span(ok: dict[str, Any]) -> None:
    """A request answered: its own trace, its times, usage and phases in GenAI's words."""
    assert ok["name"] == "text_completion tiny"
    assert ok["trace_id"] == TRACE  # the request's own trace
    start = datetime.fromisoformat("2026-11-22T05:00:00.250000+00:00").timestamp()
    assert ok["start_ns"] == int(start * 1e9)
    assert ok["end_ns"] - ok["start_ns"] == 15066 * 1_000_000
    assert ok["resource"]["service.name"] == "servescope-collector"
    a = ok["attributes"]
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.provider.name"] == "vllm"
    assert a["gen_ai.request.model"] == "tiny"
    assert a["gen_ai.usage.input_tokens"] == 1842
    assert a["gen_ai.usage.output_tokens"] == 419
    assert a["gen_ai.usage.cache_read.input_tokens"] == 1024
    assert a["gen_ai.response.finish_reasons"] == ["stop"]
    assert a["gen_ai.response.time_to_first_chunk"] == pytest.approx(0.820)
    assert "error.type" not in a
    assert (a["servescope.queue_ms"], a["servescope.prefill_ms"], a["servescope.decode_ms"]) == (
        12.5,
        790.0,
        14200.0,
    )
    assert a["servescope.team"] == "team-a"
    assert ok["status"] == 0  # unset


def check_the_rejected_span(span: dict[str, Any]) -> None:
    """A request the gateway refused: an error span with the error's class, a trace of its own."""
    assert span["attributes"]["error.type"] == "rejected:queue_full"
    assert span["attributes"]["http.response.status_code"] == 429
    assert span["status"] == 2  # error
    assert len(span["trace_id"]) == 32


def check_the_genai_metrics(m: dict[str, Any]) -> None:
    """The GenAI histograms: the conventions' buckets, TTFT of successes only, durations by error
    class, tokens by type."""
    assert bounds(m["gen_ai.server.time_to_first_token"][-1]) == TTFT_BUCKETS
    assert bounds(m["gen_ai.server.time_per_output_token"][-1]) == TPOT_BUCKETS
    assert bounds(m["gen_ai.server.request.duration"][-1]) == DURATION_BUCKETS
    assert bounds(m["gen_ai.client.token.usage"][-1])[-1] == 67108864
    assert bounds(m["gen_ai.client.token.usage"][-1]) == TOKEN_BUCKETS
    ttft = m["gen_ai.server.time_to_first_token"][-1].histogram.data_points
    assert [(p.count, p.sum) for p in ttft] == [(1, pytest.approx(0.820))]  # successes only
    durations = m["gen_ai.server.request.duration"][-1].histogram.data_points
    by_error = {
        next((kv.value.string_value for kv in p.attributes if kv.key == "error.type"), None): p
        for p in durations
    }
    assert by_error[None].sum == pytest.approx(15.066)
    assert by_error["rejected:queue_full"].count == 1
    tokens = m["gen_ai.client.token.usage"][-1].histogram.data_points
    by_type = {
        next(kv.value.string_value for kv in p.attributes if kv.key == "gen_ai.token.type"): p.sum
        for p in tokens
    }
    assert by_type == {"input": 1842, "output": 419}
    assert m["gen_ai.client.token.usage"][-1].unit == "{token}"


def test_vllm_legacy_span_keys_map_to_the_current_conventions() -> None:
    legacy = {
        "gen_ai.usage.prompt_tokens": 7,
        "gen_ai.usage.completion_tokens": 3,
        "gen_ai.system": "vllm",
        "gen_ai.latency.time_to_first_token": 0.05,
        "gen_ai.latency.time_in_queue": 0.25,
        "gen_ai.latency.time_in_model_prefill": 0.01,
        "gen_ai.latency.time_in_model_decode": 0.2,
        "gen_ai.request.max_tokens": 3,
    }
    current = current_attributes(legacy)
    assert current["gen_ai.usage.input_tokens"] == 7
    assert current["gen_ai.usage.output_tokens"] == 3
    assert current["gen_ai.provider.name"] == "vllm"
    assert current["gen_ai.response.time_to_first_chunk"] == 0.05
    assert current["servescope.queue_ms"] == pytest.approx(250.0)
    assert current["gen_ai.request.max_tokens"] == 3
    assert not any(k.startswith("gen_ai.latency.") for k in current)
    assert "gen_ai.usage.prompt_tokens" not in current
    # a stored record that carries a trace's raw attributes exports the current names
    record = {"request_id": "r-000001", "model": "tiny", **legacy}
    with otlp_http_sink() as sink:
        export = OtlpExport(sink.url, registry=CollectorRegistry(), schedule_delay_s=0.05)
        export.submit([record])
        export.shutdown()
        sink.wait_for(lambda s: len(s.spans) == 1)
    attrs = sink.spans[0]["attributes"]
    assert attrs["gen_ai.usage.input_tokens"] == 7
    assert attrs["servescope.queue_ms"] == pytest.approx(250.0)
    assert "gen_ai.usage.prompt_tokens" not in attrs


def test_otel_environment_variables_are_honoured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with otlp_http_sink() as sink:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", sink.url)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=lab11")
        monkeypatch.setenv("OTEL_SERVICE_NAME", "servescope-lab")
        monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
        export = OtlpExport(None, registry=CollectorRegistry(), schedule_delay_s=0.05)
        export.submit(stored_records(tmp_path))
        export.shutdown()
        sink.wait_for(lambda s: len(s.spans) == 2)
    assert sink.spans[0]["resource"]["service.name"] == "servescope-lab"
    assert sink.spans[0]["resource"]["deployment.environment"] == "test"
    assert all(h.get("x-tenant") == "lab11" for h in sink.headers)


def test_grpc_export_reaches_a_grpc_endpoint(tmp_path: Path) -> None:
    received: list[trace_service_pb2.ExportTraceServiceRequest] = []

    class Traces(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, _context: Any) -> Any:  # noqa: N802 - the gRPC API
            received.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
        def Export(self, _request: Any, _context: Any) -> Any:  # noqa: N802 - the gRPC API
            return metrics_service_pb2.ExportMetricsServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        export = OtlpExport(
            f"http://127.0.0.1:{port}",
            protocol="grpc",
            registry=CollectorRegistry(),
            schedule_delay_s=0.05,
        )
        export.submit(stored_records(tmp_path))
        assert export.flush(30)
        export.shutdown()
    finally:
        server.stop(0)
    names = [
        kv.value.string_value
        for request in received
        for rs in request.resource_spans
        for ss in rs.scope_spans
        for span in ss.spans
        for kv in span.attributes
        if kv.key == "gen_ai.provider.name"
    ]
    assert names == ["vllm", "vllm"]


def test_runtime_events_are_not_exported_as_requests(tmp_path: Path) -> None:
    with otlp_http_sink() as sink:
        export = OtlpExport(sink.url, registry=CollectorRegistry(), schedule_delay_s=0.05)
        export.submit(
            [{"type": "tool_call", "run_id": RUN, "request_id": "x-1"}, *stored_records(tmp_path)]
        )
        export.shutdown()
        sink.wait_for(lambda s: len(s.spans) == 2)
    assert {s["attributes"]["servescope.request_id"] for s in sink.spans} == {
        f"{RUN}-000001",
        f"{RUN}-000002",
    }


def test_pieces_of_one_request_in_two_flushes_become_one_span(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    key = (RUN, f"{RUN}-000001")
    client = {k: v for k, v in RECORDS[0].items() if k not in ("queue_ms", "prefill_ms")}
    trace = {"request_id": key[1], "run_id": RUN, "source": "vllm-trace", "queue_ms": 12.5,
             "prefill_ms": 790.0}  # fmt: skip
    with otlp_http_sink() as sink:
        export = OtlpExport(sink.url, registry=CollectorRegistry(), schedule_delay_s=0.05)
        # The first flush's deadline is an hour away, so the request waits for its second
        # piece however slow that write is; the second flush re-arms it for almost now.
        forwarder = StoredRequestForwarder(store, export, settle_s=3600.0, poll_s=0.05)
        store.add_events([client])
        forwarder(SimpleNamespace(keys=[key]))  # what Collector.flush reports
        store.add_events([trace])
        forwarder.settle_s = 0.1
        forwarder(SimpleNamespace(keys=[key]))
        sink.wait_for(lambda s: len(s.spans) == 1)  # forwarded by its deadline, not by close()
        assert forwarder.pending() == 0
        forwarder.close()
    assert len(sink.spans) == 1
    attrs = sink.spans[0]["attributes"]
    assert attrs["servescope.queue_ms"] == 12.5  # from the trace piece
    assert attrs["gen_ai.usage.output_tokens"] == 419  # from the client piece
    assert attrs["servescope.source"] == "client"
