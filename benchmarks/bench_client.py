"""Benchmark: our streaming client against `vllm bench serve`'s, on an instant server.

The instant server is nginx returning a canned SSE completion of 16 content chunks (plus the
usage chunk and `[DONE]`) for every request, so what limits the request rate is the client
itself. Both clients run in fresh processes, one after the other, in the same run, with the
same request count, at each concurrency of `--concurrency`, in `--rounds` interleaved rounds
(the machine is shared: interleaving spreads other load over both sides); each side's figure is
its best (the highest rate it sustains at any of those concurrencies, in any round). Ours also
reports its TTFT against the instant server (p50, best round) at concurrency 64 and at
concurrency 1: the clock read right before the request goes to the kernel → the kernel's
receive stamp of the first token's bytes (`loadgen.transport`). Against an instant server that is
an upper bound of what the client adds to a TTFT it measures; the wait of an arrived response
for a saturated event loop is not in it (it was, 17 ms at 64, when arrivals were read times).
The reference's TTFT is its own definition (`perf_counter` when its loop handles the chunk).

Usage: .venv/bin/python benchmarks/bench_client.py [--requests 4000] [--concurrency 16,64,256]
Last line: {"metric": "client_requests_per_s", "ours": X, "reference": Y, "ratio": X/Y, ...}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from servescope.loadgen.tiny_model import model_dir  # noqa: E402
from servescope.store.settings import free_port  # noqa: E402

CHUNKS = 16
MODEL = "tiny"
TTFT_CONCURRENCY = 64


def canned_stream() -> str:
    """16 content chunks, a usage chunk and `[DONE]`, as vLLM streams a completion."""
    lines = []
    for i in range(CHUNKS):
        finish = '"length"' if i == CHUNKS - 1 else "null"
        lines.append(
            'data: {"id":"cmpl-bench","object":"text_completion","created":1,"model":"tiny",'
            f'"choices":[{{"index":0,"text":" tok{i}","logprobs":null,"finish_reason":{finish},'
            '"stop_reason":null}],"usage":null}'
        )
    lines.append(
        'data: {"id":"cmpl-bench","object":"text_completion","created":1,"model":"tiny",'
        '"choices":[],"usage":{"prompt_tokens":16,"total_tokens":32,"completion_tokens":16}}'
    )
    lines.append("data: [DONE]")
    return "".join(line + "\\n\\n" for line in lines)


class InstantServer:
    """nginx, not daemonised, with its own config, pid and logs in a temp dir."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="servescope-nginx-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> InstantServer:
        temps = "\n".join(
            f"    {n}_temp_path {self.dir}/{n};"
            for n in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        (self.dir / "nginx.conf").write_text(
            f"""daemon off;
worker_processes 1;
pid {self.dir}/nginx.pid;
error_log {self.dir}/error.log;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    keepalive_requests 10000000;
    keepalive_timeout 300s;
{temps}
    server {{
        listen 127.0.0.1:{self.port};
        location /v1/completions {{
            default_type text/event-stream;
            return 200 '{canned_stream()}';
        }}
        location /v1/models {{
            default_type application/json;
            return 200 '{{"object":"list","data":[{{"id":"{MODEL}","object":"model"}}]}}';
        }}
    }}
}}
"""
        )
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        self.process = subprocess.Popen(
            [nginx, "-p", str(self.dir), "-e", str(self.dir / "error.log"), "-c", "nginx.conf"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=1):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"nginx did not start: {(self.dir / 'error.log').read_text()}")

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


# -- our client (run in its own process) ---------------------------------------------------------


async def _ours(url: str, requests: int, concurrency: int) -> dict[str, Any]:
    """What `bench run` does per request: stream it with the shared client over the runner's
    HTTP/1.1 keep-alive pool, and write the event out."""
    from servescope.loadgen.client import stream_request
    from servescope.loadgen.transport import Http1Pool
    from servescope.wire.stream import COMPLETIONS

    body = {"model": MODEL, "prompt": "hello " * 16, "max_tokens": 16, "ignore_eos": True}
    events: list[dict[str, Any]] = []
    sink = open(os.devnull, "w")  # noqa: SIM115 - the runner writes every event to a file
    pool = Http1Pool(url)
    ids = iter(range(requests))

    async def worker() -> None:
        for i in ids:
            event = await stream_request(pool, url, COMPLETIONS, body, f"bench-{i:06d}")
            events.append(event)
            sink.write(json.dumps(event) + "\n")

    await asyncio.gather(*(worker() for _ in range(concurrency)))  # warm connections
    ids = iter(range(requests))
    events.clear()
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    pool.close()
    ok = [e for e in events if e["status"] == "ok" and e.get("completion_tokens") == CHUNKS]
    ttft = [e["ttft_ms"] for e in ok]
    return {
        "requests": len(events),
        "ok": len(ok),
        "requests_per_s": len(ok) / wall,
        "ttft_ms_p50": statistics.median(ttft) if ttft else None,
    }


def _reference(url: str, requests: int, concurrency: int, tokenizer: str) -> dict[str, Any]:
    from vllm.benchmarks.serve import add_cli_args, main

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        [
            "--backend", "vllm",
            "--base-url", url,
            "--endpoint", "/v1/completions",
            "--model", MODEL,
            "--tokenizer", tokenizer,
            "--dataset-name", "random",
            "--random-input-len", "16",
            "--random-output-len", "16",
            "--num-prompts", str(requests),
            "--max-concurrency", str(concurrency),
            "--request-rate", "inf",
            "--disable-tqdm",
            "--ready-check-timeout-sec", "0",
        ]
    )  # fmt: skip
    with open(os.devnull, "w") as quiet:
        stdout = sys.stdout
        sys.stdout = quiet
        try:
            result = main(args)
        finally:
            sys.stdout = stdout
    return {
        "requests": requests,
        "ok": result["completed"],
        "requests_per_s": result["request_throughput"],
        "ttft_ms_p50": result["median_ttft_ms"],
    }


def _worker(side: str, url: str, requests: int, concurrency: int, tokenizer: str) -> dict:
    """One measurement in a fresh interpreter, so neither side inherits the other's state."""
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--worker",
            side,
            "--url",
            url,
            "--requests",
            str(requests),
            "--concurrency",
            str(concurrency),
            "--tokenizer",
            tokenizer,
        ],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{side} worker failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--concurrency", default="16,64,256")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokenizer", default=str(ROOT / model_dir()))
    parser.add_argument("--worker", choices=("ours", "reference"), help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "ours":
        print(json.dumps(asyncio.run(_ours(args.url, args.requests, int(args.concurrency)))))
        return 0
    if args.worker == "reference":
        result = _reference(args.url, args.requests, int(args.concurrency), args.tokenizer)
        print(json.dumps(result))
        return 0
    levels = [int(c) for c in args.concurrency.split(",")]
    rows: dict[str, dict[int, list[dict]]] = {"ours": {}, "reference": {}}
    with InstantServer() as server:
        print(f"instant server: nginx on {server.url}, {CHUNKS} chunks per completion")
        for round_ in range(1, args.rounds + 1):
            for concurrency in levels:
                for side in ("ours", "reference"):
                    row = _worker(side, server.url, args.requests, concurrency, args.tokenizer)
                    if row["ok"] != args.requests:
                        raise RuntimeError(
                            f"{side} @ {concurrency}: {row['ok']} of {args.requests} ok"
                        )
                    rows[side].setdefault(concurrency, []).append(row)
                    print(
                        f"round {round_} {side:9s} concurrency {concurrency:4d}: "
                        f"{row['requests_per_s']:8.1f} req/s, TTFT p50 {row['ttft_ms_p50']:.3f} ms"
                    )
        single = _worker("ours", server.url, min(args.requests, 1000), 1, args.tokenizer)
    best = {
        side: max((r for runs in by_c.values() for r in runs), key=lambda r: r["requests_per_s"])
        for side, by_c in rows.items()
    }
    ours, reference = best["ours"]["requests_per_s"], best["reference"]["requests_per_s"]
    at64 = min((r["ttft_ms_p50"] for r in rows["ours"].get(TTFT_CONCURRENCY, [])), default=None)
    for side, by_c in rows.items():
        for concurrency, runs in by_c.items():
            top = max(r["requests_per_s"] for r in runs)
            print(f"best {side:9s} concurrency {concurrency:4d}: {top:8.1f} req/s")
    print(f"ours at concurrency 1: TTFT p50 {single['ttft_ms_p50']:.3f} ms")
    print(
        json.dumps(
            {
                "metric": "client_requests_per_s",
                "ours": round(ours, 1),
                "reference": round(reference, 1),
                "ratio": round(ours / reference, 2),
                "ours_ttft_ms_p50_at_64": None if at64 is None else round(at64, 3),
                "ours_ttft_ms_p50_at_1": round(single["ttft_ms_p50"], 3),
                "requests": args.requests,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
