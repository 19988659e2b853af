"""OTLP export: the SDK's real exporters send stored requests to an OTLP endpoint started here;
the decoded protobuf carries the GenAI names and the stored values. With the endpoint down,
`submit` still returns at once and the drop counter rises."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from prometheus_client import CollectorRegistry, generate_latest

from servescope.collector.otlp_export import (
    OtlpExport,
    exporters,
)
from servescope.store import Store
from tests.helpers.cli import servescope
from tests.helpers.otlp_records import RECORDS, RUN, TRACE, stored_records
from tests.helpers.otlp_sink import otlp_http_sink


def test_collect_otlp_export_forwards_each_stored_request_once(tmp_path: Path) -> None:
    """`servescope collect --otlp-export URL`: the requests the collector stores reach the
    endpoint as one span each (runtime lines of the same file are stored, not exported)."""
    events = tmp_path / "client.events.jsonl"
    lines = [*RECORDS, {"type": "tool_call", "run_id": RUN, "tool": "pytest"}]
    events.write_text("".join(json.dumps(r) + "\n" for r in lines))
    db = tmp_path / "s.duckdb"
    with otlp_http_sink() as sink:
        result = servescope(
            "collect", "--once", "--events", str(events), "--otlp-export", sink.url,
            "--store", str(db), "--json",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        sink.wait_for(lambda s: len(s.spans) == 2)
    by_id = {s["attributes"]["servescope.request_id"]: s for s in sink.spans}
    assert set(by_id) == {f"{RUN}-000001", f"{RUN}-000002"}
    assert by_id[f"{RUN}-000001"]["trace_id"] == TRACE
    assert by_id[f"{RUN}-000001"]["attributes"]["gen_ai.usage.input_tokens"] == 1842
    assert Store(db).runtime_events(RUN)[0]["event"]["tool"] == "pytest"


def test_collect_with_an_unreachable_endpoint_still_stores_everything(tmp_path: Path) -> None:
    events = tmp_path / "client.events.jsonl"
    events.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    db = tmp_path / "s.duckdb"
    result = servescope(
        "collect", "--once", "--events", str(events), "--otlp-export",
        f"http://127.0.0.1:{closed_port()}", "--store", str(db), "--json",
        env={"OTEL_EXPORTER_OTLP_TIMEOUT": "1"}, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1])["events"] == 2
    assert {e["request_id"] for e in Store(db).export_events(RUN)} == {
        f"{RUN}-000001",
        f"{RUN}-000002",
    }


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_an_unreachable_endpoint_never_blocks_submit_and_counts_drops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "2")  # the exporter's retry deadline
    url = f"http://127.0.0.1:{closed_port()}"
    looked = threading.Event()

    class Held(OTLPSpanExporter):  # the real exporter, held until the test has looked
        def export(self, spans: Any) -> Any:
            looked.wait(120)
            return super().export(spans)

    registry = CollectorRegistry()
    export = OtlpExport(
        url,
        registry=registry,
        max_queue=100,
        batch_size=50,
        schedule_delay_s=0.05,
        span_exporter=Held(endpoint=f"{url}/v1/traces"),
        metric_exporter=exporters(url)[1],
    )
    record = stored_records(tmp_path)[0]
    records = [{**record, "request_id": f"{RUN}-{i:06d}"} for i in range(5000)]
    dropped = export.submit(records)
    # submit returned while the worker still waits on its first export (held, then retried
    # for 2 s): nothing exported, nothing failed yet, and the queue overflow is counted, not
    # buffered
    assert export.exported() == 0
    assert registry.get_sample_value(
        "servescope_collector_export_dropped_total", {"reason": "export_failed"}
    ) in (None, 0.0)
    assert dropped >= 5000 - 100 - 50
    assert export.dropped() == dropped
    looked.set()
    # the batches in flight fail after the exporter's retries, and are counted too
    assert export.flush(60)
    assert export.dropped() == 5000
    assert (
        registry.get_sample_value(
            "servescope_collector_export_dropped_total", {"reason": "export_failed"}
        )
        == 5000 - dropped
    )
    export.shutdown(5)
    text = generate_latest(registry).decode()
    assert 'servescope_collector_export_dropped_total{reason="queue_full"}' in text


def test_a_down_endpoint_costs_one_converted_span_per_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Until the endpoint takes an export, a batch is led by a one-span probe: the rest of the
    batch is never turned into spans while the endpoint is down (that work would be taken from
    ingestion), yet every record is still accounted for as dropped."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    sizes: list[int] = []

    class Counting(OTLPSpanExporter):  # the real exporter, counting what it is handed
        def export(self, spans: Any) -> Any:
            sizes.append(len(spans))
            return super().export(spans)

    registry = CollectorRegistry()
    export = OtlpExport(
        registry=registry,
        batch_size=50,
        schedule_delay_s=0.05,
        span_exporter=Counting(endpoint=f"http://127.0.0.1:{closed_port()}/v1/traces"),
        metric_exporter=exporters(f"http://127.0.0.1:{closed_port()}")[1],
    )
    record = stored_records(tmp_path)[0]
    export.submit([{**record, "request_id": f"{RUN}-{i:06d}"} for i in range(150)])
    assert export.flush(60)
    assert sizes and set(sizes) == {1}  # probes only
    assert export.dropped() == 150 and export.exported() == 0
    with otlp_http_sink() as sink:  # once an endpoint answers, batches go whole again
        export = OtlpExport(sink.url, registry=CollectorRegistry(), batch_size=50,
                            schedule_delay_s=0.05)  # fmt: skip
        export.submit([{**record, "request_id": f"{RUN}-{i:06d}"} for i in range(150)])
        assert export.flush(60)
        assert export.exported() == 150
        export.shutdown()
