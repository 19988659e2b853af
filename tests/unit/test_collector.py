"""The collector's parts on real files, a real DuckDB store, the real OTel SDK exporter and the
CLI as a user runs it (the end-to-end test with vLLM is tests/e2e/test_collector_e2e.py)."""

from __future__ import annotations

import http.server
import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from servescope.collector import Collector
from servescope.collector.sources.events import EventsFiles
from servescope.collector.sources.metrics import MetricsTarget
from servescope.collector.sources.otlp import OtlpTraces
from servescope.store import Store
from servescope.store.settings import free_port
from servescope.wire.ids import client_request_id
from servescope.wire.vllm_log import Access, Levers, Piece, Stats, Tick, parse_line
from tests.helpers.lines import ACCESS, ADDED, LEVERS, RECEIVED
from tests.helpers.stand_ins import RestartableVllmMetrics

STATS = (
    "(APIServer pid=6485) INFO 11-22 04:30:02 [loggers.py:335] Engine 000: Avg prompt "
    "throughput: 3.4 tokens/s, Avg generation throughput: 1.5 tokens/s, Running: 0 reqs, "
    "Waiting: 0 reqs, CPU KV cache usage: 0.0%, Prefix cache hit rate: 84.1%"
)


def test_vllm_ids_map_back_to_the_client_id() -> None:
    assert client_request_id("cmpl-run-20260512-000001-0") == "run-20260512-000001"
    assert client_request_id("chatcmpl-run-20260512-000002") == "run-20260512-000002"
    assert client_request_id("cmpl-R-0-88bc5d5c", engine=True) == "R"
    assert client_request_id("chatcmpl-R-bc3e9560", engine=True) == "R"
    assert client_request_id("plain-id") == "plain-id"


def test_text_lines() -> None:
    received = parse_line(RECEIVED.encode(), year=2026)
    assert isinstance(received, Piece)
    assert received.doc["request_id"] == "h3probe-000001"
    assert received.doc["max_tokens"] == 5 and received.doc["log_ts"].startswith("2026-11-22T04")
    added = parse_line(ADDED.encode(), year=2026)
    assert isinstance(added, Piece) and added.doc["request_id"] == "h3probe-000001"
    assert parse_line(ACCESS.encode(), year=2026) == Access("POST", "/v1/completions", 200)
    stats = parse_line(STATS.encode(), year=2026)
    assert isinstance(stats, Stats) and stats.engine == "000"
    assert stats.values["avg_prompt_throughput"] == 3.4
    assert stats.values["prefix_cache_hit_rate"] == pytest.approx(0.841)
    levers = parse_line(LEVERS.encode(), year=2026)
    assert isinstance(levers, Levers)
    assert levers.levers["max_model_len"] == 16384 and "port" not in levers.levers
    failed = parse_line(
        b"(APIServer pid=1) INFO 11-22 04:29:59 [async_llm.py:819] Request cmpl-x-000003-0 "
        b"failed due to ValueError: boom.",
        year=2026,
    )
    assert isinstance(failed, Piece)
    assert failed.doc["server_outcome"] == "failed" and "boom" in failed.doc["server_error"]
    aborted = parse_line(b"(APIServer pid=1) INFO 11-22 04:29:59 [a.py:1] Request chatcmpl-q "
                         b"aborted.", year=2026)  # fmt: skip
    assert isinstance(aborted, Piece) and aborted.doc["server_outcome"] == "aborted"
    route = parse_line(b"(APIServer pid=1) INFO 11-22 04:28:42 [x.py:1] Route: /v1", year=2026)
    assert isinstance(route, Tick) and route.ts.hour == 4  # says nothing but the server's time


class _ChangingMetrics(RestartableVllmMetrics):
    """A vLLM restarted with other flags between two scrapes, with legacy names."""

    CONFIG = {"enable_prefix_caching": "True", "block_size": "16"}
    STARTED = 1795500000.0
    LABELS = 'engine="0",model_name="tiny"'
    EXTRA = (
        "# TYPE vllm:gpu_cache_usage_perc gauge\n"
        'vllm:gpu_cache_usage_perc{model_name="tiny"} 0.25\n'
    )


def test_scrapes_record_down_targets_legacy_names_and_cache_lever_flips(tmp_path: Path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ChangingMetrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    down = f"http://127.0.0.1:{free_port()}/metrics"
    store = Store(tmp_path / "s.duckdb")
    try:
        Collector(store, [MetricsTarget(url), MetricsTarget(down)], once=True).run_once()
        _ChangingMetrics.CONFIG = {"enable_prefix_caching": "False", "block_size": "16"}
        _ChangingMetrics.STARTED += 120
        Collector(store, [MetricsTarget(url), MetricsTarget(down)], once=True).run_once()
    finally:
        server.shutdown()
    with store.read() as con:
        up = dict(con.execute(
            "SELECT target, max(value) FROM metric_samples WHERE name = 'up' GROUP BY 1"
        ).fetchall())  # fmt: skip
        kv = con.execute(
            "SELECT count(*) FROM metric_samples WHERE name = 'vllm:kv_cache_usage_perc'"
        ).fetchone()
        flips = con.execute(
            "SELECT lever, before, after, before_run_id, run_id FROM lever_flips"
        ).fetchall()
        runs = con.execute("SELECT run_id, model, levers FROM runs ORDER BY started_at").fetchall()
    assert up == {url: 1.0, down: 0.0}
    assert kv == (2,)
    port = server.server_address[1]
    first, second = f"vllm-tiny-{port}-20261124T060000Z", f"vllm-tiny-{port}-20261124T060200Z"
    assert [(r[0], r[1], json.loads(r[2])["enable_prefix_caching"]) for r in runs] == [
        (first, "tiny", True),
        (second, "tiny", False),
    ]  # each process start is a session of the target; the labels in the flags' spelling
    assert flips == [("enable_prefix_caching", "true", "false", first, second)]


def _llm_request_span(tracer_provider: TracerProvider, request_id: str) -> None:
    tracer = tracer_provider.get_tracer("vllm")
    attrs = {
        "gen_ai.request.id": f"cmpl-{request_id}-0",
        "gen_ai.latency.time_in_queue": 0.002,
        "gen_ai.latency.time_in_model_prefill": 0.010,
        "gen_ai.latency.time_in_model_decode": 0.050,
        "gen_ai.latency.time_in_model_inference": 0.060,
        "gen_ai.latency.time_to_first_token": 0.015,
        "gen_ai.latency.e2e": 0.065,
        "gen_ai.usage.prompt_tokens": 32,
        "gen_ai.usage.completion_tokens": 8,
        "gen_ai.request.max_tokens": 8,
    }
    with tracer.start_as_current_span("llm_request", attributes=attrs):
        pass


def test_otlp_protobuf_and_json_merge_with_the_client_record_in_any_order(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    receiver = OtlpTraces(port=0)
    collector = Collector(store, [receiver])
    collector.start()
    stop = threading.Event()
    loop = threading.Thread(target=collector.run, args=(stop,), daemon=True)
    loop.start()
    try:
        client = {"request_id": "run-20261122-otlp-000001", "ttft_ms": 20.0, "e2e_ms": 70.0}
        store.add_events([client])  # the client's record first, the trace later
        provider = TracerProvider()
        exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{receiver.port}/v1/traces")
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        _llm_request_span(provider, "run-20261122-otlp-000001")
        _llm_request_span(provider, "run-20261122-otlp-000002")  # trace first, client later
        provider.shutdown()
        body = {"resourceSpans": [{"scopeSpans": [{"spans": [{
            "name": "llm_request", "traceId": "0af7651916cd43dd8448eb211c80319c",
            "startTimeUnixNano": "1795321799000000000",
            "attributes": [
                {"key": "gen_ai.request.id",
                 "value": {"stringValue": "chatcmpl-run-20261122-otlp-000003"}},
                {"key": "gen_ai.latency.time_in_queue", "value": {"doubleValue": 0.5}},
                {"key": "gen_ai.usage.completion_tokens", "value": {"intValue": "4"}},
            ],
        }]}]}]}  # fmt: skip
        request = urllib.request.Request(
            f"http://127.0.0.1:{receiver.port}/v1/traces", json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request) as resp:
            assert resp.status == 200
        garbage = urllib.request.Request(
            f"http://127.0.0.1:{receiver.port}/v1/traces", b"\x00garbage\xff",
            {"Content-Type": "application/x-protobuf"},
        )  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(garbage)
        assert refused.value.code == 400
        store.add_events([{"request_id": "run-20261122-otlp-000002", "ttft_ms": 21.0}])
    finally:
        stop.set()
        loop.join(timeout=30)  # its last flush, then the receiver stops
    with store.read() as con:
        rows = con.execute(
            "SELECT request_id, ttft_ms, queue_ms, prefill_ms, decode_ms, completion_tokens "
            "FROM events ORDER BY request_id"
        ).fetchall()
        errors = con.execute("SELECT source, reason FROM ingest_errors").fetchall()
    assert rows == [
        ("run-20261122-otlp-000001", 20.0, 2.0, 10.0, 50.0, 8),
        ("run-20261122-otlp-000002", 21.0, 2.0, 10.0, 50.0, 8),
        ("run-20261122-otlp-000003", None, 500.0, None, None, 4),
    ]
    assert len(errors) == 1 and errors[0][0] == "otlp" and "protobuf" in errors[0][1]


def test_rotation_deletion_and_partial_lines_in_process(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    path = tmp_path / "e.events.jsonl"

    def line(i: int) -> bytes:
        return json.dumps({"request_id": f"run-20261122-rot-{i:04d}"}).encode() + b"\n"

    collector = Collector(store, [EventsFiles(str(path))])
    path.write_bytes(line(0) + line(1)[:10])  # a partial last line
    collector.poll()
    collector.flush()
    with path.open("ab") as fh:
        fh.write(line(1)[10:] + line(2))
    path.rename(tmp_path / "e.events.jsonl.1")  # rotation by rename, then a new file
    path.write_bytes(line(3))
    collector.poll()
    collector.poll()
    collector.flush()
    (tmp_path / "e.events.jsonl.1").unlink()
    with path.open("ab") as fh:  # written after a deletion of the old file: still read
        fh.write(line(4))
    collector.poll()
    collector.flush()
    collector.close()
    # a restart reads nothing twice
    again = Collector(store, [EventsFiles(str(path))])
    again.poll()
    again.flush()
    again.close()
    with store.read() as con:
        ids = [r[0] for r in con.execute("SELECT request_id FROM events ORDER BY 1").fetchall()]
    assert ids == [f"run-20261122-rot-{i:04d}" for i in range(5)]
    source = {"source": f"events:{path}"}
    read = [c.metrics.registry.get_sample_value("servescope_collector_lines_total", source)
            for c in (collector, again)]  # fmt: skip
    assert read == [5.0, None]  # the partial line counted once, when complete


def test_a_backlog_larger_than_the_ram_folder_is_still_ingested(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A container's /dev/shm is 64 MiB; a backlog's chunk is larger. Faked here (a folder whose
    free space is reported as 1 MiB), as a full RAM disk cannot be made without root: before,
    every flush failed with ENOSPC and was retried forever; now the chunk goes to the system's
    temporary folder and every event is stored."""
    from servescope.store import bulk

    ram = tmp_path / "ram"
    ram.mkdir()
    monkeypatch.setattr(bulk, "RAM_DIR", str(ram))
    disk_usage = bulk.shutil.disk_usage

    def full(path: str) -> object:
        usage = disk_usage(path)
        return usage._replace(free=2**20) if Path(path) == ram else usage

    monkeypatch.setattr(bulk.shutil, "disk_usage", full)
    events = tmp_path / "backlog.events.jsonl"
    n = 20_000  # about 3 MiB
    with events.open("w") as fh:
        for i in range(n):
            fh.write(json.dumps({"request_id": f"run-20261124-big-{i:06d}", "ttft_ms": i % 97}))
            fh.write("\n")
    store = Store(tmp_path / "s.duckdb")
    collector = Collector(store, [EventsFiles(str(events))])
    collector.poll()
    report = collector.flush()
    collector.close()
    assert report is not None and report.events == n
    assert not list(ram.iterdir())
    with store.read() as con:
        assert con.execute("SELECT count(DISTINCT request_id) FROM events").fetchone() == (n,)
