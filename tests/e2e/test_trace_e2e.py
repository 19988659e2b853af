"""One trace per request, end to end on real parts: `servescope bench run` → the gateway → a real
vLLM started with `--otlp-traces-endpoint` at the collector's receiver. The client's and the
gateway's spans go to an OTLP endpoint started here; vLLM's `llm_request` span goes to the
collector, which stores it and forwards the stored request (`--otlp-export`) to the same
endpoint. All of them carry one trace id per request, and so do the stored events."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import time
from pathlib import Path

import aiohttp
import duckdb
import pytest
import yaml

from servescope.loadgen.client import stream_request
from servescope.store.settings import free_port
from servescope.wire.stream import COMPLETIONS
from tests.helpers.cli import ROOT, SERVESCOPE, bench_args
from tests.helpers.otlp_sink import otlp_http_sink
from tests.helpers.vllm import RunningServer

RUN = "run-20261122-traced"
KEY = "sk-trace-test"


def wait_port(port: int, process: subprocess.Popen[str], what: str) -> None:
    deadline = time.monotonic() + 120
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{what} did not start: {process.communicate()}") from None
            time.sleep(0.2)


def stored(db: Path) -> dict[str, dict]:
    with duckdb.connect(str(db), read_only=True) as con:
        rows = con.execute("SELECT request_id, doc FROM events WHERE run_id = ?", [RUN]).fetchall()
    return {rid: json.loads(doc) for rid, doc in rows}


@pytest.mark.vllm
def test_bench_gateway_and_vllm_spans_share_one_trace_per_request(
    vllm_server: RunningServer, tmp_path: Path
) -> None:
    gateway_port, metrics_port = free_port(), free_port()
    events_dir = tmp_path / "gateway-events"
    config = tmp_path / "gateway.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "listen": {"host": "127.0.0.1", "port": gateway_port},
                "events_dir": str(events_dir),
                "upstreams": {"vllm": {"url": vllm_server.url, "model": "tiny"}},
                "teams": {"lab": {"keys": [KEY]}},
            }
        )
    )
    workload = tmp_path / "traced.yaml"
    workload.write_text(
        yaml.safe_dump(
            {
                "workloads": [
                    {"name": "traced", "input_tokens": 32, "output_tokens": 8, "concurrency": [1]}
                ],
                "requests_per_level": 3,
                "team": "lab",
            }
        )
    )
    bench_db, collector_db = tmp_path / "bench.duckdb", tmp_path / "collector.duckdb"
    with otlp_http_sink() as sink:
        env = {
            **os.environ,
            "OTEL_EXPORTER_OTLP_ENDPOINT": sink.url,
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            "SERVESCOPE_KEY_LAB": KEY,
        }
        # the collector: vLLM's traces in, stored requests out as OTLP (its own store, so what
        # it stores for a request is what vLLM's span said)
        collector = subprocess.Popen(
            [
                *SERVESCOPE,
                "collect",
                "--otlp-port",
                str(vllm_server.otlp_port),
                "--metrics-port",
                str(metrics_port),
                "--otlp-export",
                sink.url,
                "--store",
                str(collector_db),
            ],  # fmt: skip
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        gateway = subprocess.Popen(
            [*SERVESCOPE, "gateway", "--config", str(config)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_port(vllm_server.otlp_port, collector, "the collector")
            wait_port(gateway_port, gateway, "the gateway")
            bench = subprocess.run(
                [
                    *SERVESCOPE,
                    *bench_args(workload, f"http://127.0.0.1:{gateway_port}", RUN, bench_db),
                ],  # fmt: skip
                cwd=tmp_path,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert bench.returncode == 0, bench.stderr
            client_events = stored(bench_db)
            assert len(client_events) == 3
            traces = {rid: e["trace_id"] for rid, e in client_events.items()}
            # vLLM exports its spans in batches (~5 s); the collector forwards a request once
            # its pieces settled (5 s): wait for one forwarded span per request
            sink.wait_for(
                lambda s: (
                    {
                        sp["attributes"].get("servescope.request_id")
                        for sp in s.spans
                        if sp["resource"]["service.name"] == "servescope-collector"
                    }
                    >= set(traces)
                ),
                timeout_s=90,
            )
        finally:
            for process in (gateway, collector):
                process.terminate()
            outputs = [p.communicate(timeout=60) for p in (gateway, collector)]
        assert collector.returncode == 0, outputs[1]

    by_service: dict[str, list[dict]] = {}
    for span in sink.spans:
        by_service.setdefault(span["resource"]["service.name"], []).append(span)
    vllm_pieces = stored(collector_db)
    gateway_events = {
        e["request_id"]: e
        for path in events_dir.glob("*.events.jsonl")
        for e in map(json.loads, path.read_text().splitlines())
    }
    for request_id, trace_id in traces.items():
        assert len(trace_id) == 32 and trace_id.strip("0")
        client = [
            s
            for s in by_service["servescope-bench"]
            if s["attributes"]["servescope.request_id"] == request_id
        ]
        assert [s["trace_id"] for s in client] == [trace_id]
        assert client[0]["parent_span_id"] == ""  # the trace starts at the client
        gateway_spans = [s for s in by_service["servescope-gateway"] if s["trace_id"] == trace_id]
        names = {s["name"] for s in gateway_spans}
        assert names == {"gateway text_completion", "gateway admission"}
        server_span = next(s for s in gateway_spans if s["name"] == "gateway text_completion")
        assert server_span["parent_span_id"] == client[0]["span_id"]
        assert gateway_events[request_id]["trace_id"] == trace_id
        # vLLM's llm_request span, as the collector received and stored it: same trace, and
        # the server-side phases it measured
        piece = vllm_pieces[request_id]
        assert piece["source"] == "vllm-trace"
        assert piece["trace_id"] == trace_id
        assert {"queue_ms", "prefill_ms", "decode_ms"} <= set(piece)
        # the collector's forwarded span of the stored request is in the same trace
        forwarded = [
            s
            for s in by_service["servescope-collector"]
            if s["attributes"]["servescope.request_id"] == request_id
        ]
        assert [s["trace_id"] for s in forwarded] == [trace_id]
        assert forwarded[0]["attributes"]["servescope.queue_ms"] == piece["queue_ms"]
        assert forwarded[0]["attributes"]["gen_ai.provider.name"] == "vllm"
        assert client_events[request_id]["trace_id"] == trace_id


@pytest.mark.vllm
def test_a_callers_own_traceparent_is_kept_in_the_event(vllm_server: RunningServer) -> None:
    """No tracer configured: the client still sends the caller's `traceparent` and the event
    records its trace id (an agent runtime that traces itself keeps one trace)."""
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    headers = {"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"}

    async def send() -> dict:
        async with aiohttp.ClientSession() as session:
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
            return await stream_request(
                session, vllm_server.url, COMPLETIONS, body, "tp-000001", headers=headers
            )

    event = asyncio.run(send())
    assert event["status"] == "ok"
    assert event["trace_id"] == trace_id
