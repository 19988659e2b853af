"""Benchmark: how far our client's TTFT is from the server's own, for the same requests.

Starts a real vLLM (the tiny model, on the CPU) that exports its `llm_request` traces to the
collector's OTLP receiver, sends `--requests` streaming requests one at a time (concurrency 1)
with the client as `bench run` uses it (`loadgen.transport.Http1Pool`: the send clock read
before the request goes to the kernel, the first token's arrival from the kernel's receive
stamp), and joins each client event to its span by request id. The gap, client TTFT minus the
trace's `gen_ai.latency.time_to_first_token`, is what lies outside the engine's own TTFT: HTTP
and the API server's work around the engine (request parsing, tokenizing, detokenizing, SSE
framing) until the first token's bytes reach the client's kernel.

Usage: .venv/bin/python benchmarks/bench_ttft_accuracy.py [--requests 50]
Last line: {"metric": "client_minus_server_ttft_ms_p50", "value": X, "target": 5.0, ...}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from servescope.collector.otlp import OtlpReceiver  # noqa: E402
from servescope.loadgen.client import stream_request  # noqa: E402
from servescope.loadgen.launcher import VllmServer  # noqa: E402
from servescope.loadgen.prompts import PromptMaker, payload_for  # noqa: E402
from servescope.loadgen.tiny_model import is_built, make_tiny_model, model_dir  # noqa: E402
from servescope.loadgen.transport import Http1Pool  # noqa: E402
from servescope.store.settings import free_port  # noqa: E402
from servescope.wire.stream import COMPLETIONS  # noqa: E402

TARGET_MS = 5.0


class Spans:
    """The receiver's sink: span pieces by request id."""

    def __init__(self) -> None:
        self.pieces: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()

    def submit(
        self, pieces: list[dict[str, Any]], _refused: list[tuple[str, str]]
    ) -> threading.Event:
        with self.lock:
            for piece in pieces:
                self.pieces[piece["request_id"]] = piece
        done = threading.Event()
        done.set()
        return done


async def client_events(url: str, requests: int, prompt_tokens: int) -> list[dict[str, Any]]:
    import aiohttp

    async with aiohttp.ClientSession() as session:  # prompts via /tokenize
        maker = PromptMaker(session, url, "tiny")
        rng = random.Random(7)
        bodies = [
            payload_for(await maker.exact(prompt_tokens, rng), "tiny", 8, chat=False)
            for _ in range(requests + 3)
        ]
    pool = Http1Pool(url)  # the requests as `bench run` sends them
    for i, body in enumerate(bodies[:3]):  # warm-up
        await stream_request(pool, url, COMPLETIONS, body, f"warm-{i:06d}")
    events = []
    for i, body in enumerate(bodies[3:]):
        events.append(await stream_request(pool, url, COMPLETIONS, body, f"acc-{i:06d}"))
    pool.close()
    return events


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--model", type=Path, default=ROOT / model_dir())
    args = parser.parse_args()
    if not is_built(args.model):
        make_tiny_model(args.model)
    spans = Spans()
    receiver = OtlpReceiver(spans.submit, port=free_port()).start()
    log = Path(tempfile.mkdtemp(prefix="servescope-acc-")) / "vllm.log"
    server = VllmServer(
        args.model,
        port=free_port(),
        served_name="tiny",
        log_path=log,
        extra_flags=["--otlp-traces-endpoint", f"http://127.0.0.1:{receiver.port}/v1/traces"],
        env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"},
    )
    print(f"starting vLLM with traces to 127.0.0.1:{receiver.port} (log {log})", flush=True)
    try:
        with server:
            events = asyncio.run(client_events(server.url, args.requests, args.prompt_tokens))
            deadline = time.monotonic() + 60
            wanted = {e["request_id"] for e in events}
            while time.monotonic() < deadline and not wanted <= set(spans.pieces):
                time.sleep(0.5)
    finally:
        receiver.stop()
    gaps = []
    for event in events:
        piece = spans.pieces.get(event["request_id"])
        if event["status"] == "ok" and piece and piece.get("server_ttft_ms") is not None:
            gaps.append(event["ttft_ms"] - piece["server_ttft_ms"])
    if not gaps:
        print("no request could be joined to its span", file=sys.stderr)
        return 1
    ordered = sorted(gaps)
    p50 = statistics.median(ordered)
    p90 = ordered[int(0.9 * (len(ordered) - 1))]
    print(
        f"{len(gaps)} of {len(events)} requests joined; client - server TTFT: p50 {p50:.2f} ms, "
        f"p90 {p90:.2f} ms, min {ordered[0]:.2f} ms, max {ordered[-1]:.2f} ms"
    )
    print(
        json.dumps(
            {
                "metric": "client_minus_server_ttft_ms_p50",
                "value": round(p50, 3),
                "p90": round(p90, 3),
                "target": TARGET_MS,
                "met": p50 <= TARGET_MS,
                "requests": len(gaps),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
