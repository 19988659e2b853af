"""What the gateway costs: the same instant server reached directly and through the gateway.

The instant server is nginx returning a canned SSE completion of 16 chunks (plus usage and
`[DONE]`), so every millisecond measured is the client's or the gateway's own. Both paths are
driven by bench's streaming client at the same concurrency, in the same run, interleaved
(direct, gateway, direct, gateway…) so machine noise hits both alike. The gateway runs as a
user runs it (`servescope gateway --config …`), in its own process, with one team whose limits
never bind, so the figures are the proxy's cost, not admission's.

    .venv/bin/python benchmarks/bench_gateway.py [--concurrency 100] [--requests 4000]

Last line (JSON): gateway_ttft_p50_ms through the gateway vs direct, the added TTFT at p50 and
p99, and the proxied ÷ direct throughput. Targets: added p50 ≤ 1 ms, p99 ≤ 5 ms, fraction ≥ 0.5.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
from rich.progress import Progress

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.client import COMPLETIONS, stream_request  # noqa: E402

KEY = "sk-bench-gateway"
CHUNKS = 16


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def canned_sse(chunks: int = CHUNKS) -> str:
    """A completions stream as vLLM sends it: `chunks` one-token messages, usage, [DONE]."""
    lines = []
    for i in range(chunks):
        choice = {"index": 0, "text": f" t{i}", "logprobs": None,
                  "finish_reason": "length" if i == chunks - 1 else None}  # fmt: skip
        doc = {"id": "cmpl-instant", "object": "text_completion", "created": 0,
               "model": "instant", "choices": [choice]}  # fmt: skip
        lines.append("data: " + json.dumps(doc))
    usage = {"prompt_tokens": 16, "completion_tokens": chunks, "total_tokens": 16 + chunks}
    doc = {"id": "cmpl-instant", "object": "text_completion", "created": 0, "model": "instant",
           "choices": [], "usage": usage}  # fmt: skip
    lines += ["data: " + json.dumps(doc), "data: [DONE]"]
    return "".join(line + "\n\n" for line in lines)


def start_nginx(folder: Path, port: int) -> subprocess.Popen[bytes]:
    """nginx in the foreground, one process, our own config and temp dirs."""
    body = canned_sse().replace("'", "\\'")
    conf = folder / "nginx.conf"
    temp = {n: folder / n for n in ("body", "proxy", "fastcgi", "uwsgi", "scgi")}
    conf.write_text(
        f"""daemon off;
master_process off;
worker_processes 1;
pid {folder}/nginx.pid;
error_log {folder}/error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  keepalive_requests 1000000;
  client_body_temp_path {temp["body"]};
  proxy_temp_path {temp["proxy"]};
  fastcgi_temp_path {temp["fastcgi"]};
  uwsgi_temp_path {temp["uwsgi"]};
  scgi_temp_path {temp["scgi"]};
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location /v1/completions {{ default_type text/event-stream; return 200 '{body}'; }}
    location /v1/models {{ default_type application/json;
      return 200 '{{"object":"list","data":[{{"id":"instant","object":"model"}}]}}'; }}
  }}
}}
"""
    )
    proc = subprocess.Popen(
        ["nginx", "-p", str(folder), "-c", str(conf), "-e", str(folder / "error.log")]
    )
    _wait_http(f"http://127.0.0.1:{port}/v1/models", proc, "nginx", folder / "error.log")
    return proc


def start_gateway(folder: Path, port: int, upstream_port: int) -> subprocess.Popen[bytes]:
    config = folder / "gateway.yaml"
    config.write_text(
        json.dumps(
            {
                "events_dir": str(folder / "events"),
                "upstreams": {
                    "instant": {"url": f"http://127.0.0.1:{upstream_port}", "max_concurrent": 10000}
                },
                "teams": {"bench": {"keys": [KEY], "max_concurrent": 10000, "max_queue": 10000}},
            }
        )
    )
    log = (folder / "gateway.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "servescope.cli",
            "gateway",
            "--config",
            str(config),
            "--port",
            str(port),
        ],  # fmt: skip
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    _wait_http(f"http://127.0.0.1:{port}/health", proc, "gateway", folder / "gateway.log")
    return proc


def _wait_http(url: str, proc: subprocess.Popen[bytes], name: str, log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    proc.kill()
    text = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    raise SystemExit(f"{name} did not start (exit {proc.poll()}):\n{text}")


async def drive(
    base_url: str,
    concurrency: int,
    requests: int,
    headers: dict[str, str],
    progress: Any,
    task: Any,
) -> tuple[list[dict[str, Any]], float]:
    """Closed loop: `concurrency` workers send `requests` streaming requests in all."""
    payload = {"model": "instant", "prompt": "x", "max_tokens": CHUNKS}
    connector = aiohttp.TCPConnector(limit=0)
    events: list[dict[str, Any]] = []
    counter = iter(range(requests))
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            for seq in counter:
                event = await stream_request(
                    session, base_url, COMPLETIONS, payload, f"bench-gw-{seq:06d}", headers=headers
                )
                events.append(event)
                progress.advance(task)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return events, elapsed


async def drive_rate(
    base_url: str, rate: float, requests: int, headers: dict[str, str]
) -> list[dict[str, Any]]:
    """Open loop at `rate` requests/s: below saturation, so what a request waits for is the
    path itself, not the requests ahead of it in the client."""
    payload = {"model": "instant", "prompt": "x", "max_tokens": CHUNKS}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = []
        start = time.perf_counter()
        for seq in range(requests):
            delay = start + seq / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(
                asyncio.create_task(
                    stream_request(
                        session, base_url, COMPLETIONS, payload, f"rate-{seq:06d}", headers=headers
                    )  # fmt: skip
                )
            )
        return list(await asyncio.gather(*tasks))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--requests", type=int, default=4000, help="per path per round")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved direct/gateway rounds")
    parser.add_argument(
        "--rate",
        type=float,
        default=200.0,
        help="also an open-loop round at this rate (req/s, below saturation), where the added "
        "latency is the gateway's own cost rather than client-side queueing; 0 to skip",
    )
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    nginx_port, gateway_port = free_port(), free_port()
    nginx = start_nginx(folder, nginx_port)
    gateway = start_gateway(folder, gateway_port, nginx_port)
    paths = {
        "direct": (f"http://127.0.0.1:{nginx_port}", {}),
        "gateway": (f"http://127.0.0.1:{gateway_port}", {"Authorization": f"Bearer {KEY}"}),
    }
    results: dict[str, dict[str, Any]] = {p: {"ttft": [], "ok": 0, "n": 0, "s": 0.0} for p in paths}
    try:
        with Progress(transient=True) as progress:
            warm = progress.add_task("warm-up", total=2 * 500)
            for url, headers in paths.values():
                asyncio.run(drive(url, args.concurrency, 500, headers, progress, warm))
            for r in range(args.rounds):
                for name, (url, headers) in paths.items():
                    task = progress.add_task(f"round {r + 1}: {name}", total=args.requests)
                    events, elapsed = asyncio.run(
                        drive(url, args.concurrency, args.requests, headers, progress, task)
                    )
                    res = results[name]
                    ok = [e for e in events if e["status"] == "ok" and "ttft_ms" in e]
                    res["ttft"] += [e["ttft_ms"] for e in ok]
                    res["ok"] += len(ok)
                    res["n"] += len(events)
                    res["s"] += elapsed
        at_rate: dict[str, list[float]] = {name: [] for name in paths}
        if args.rate > 0:
            n = int(args.rate * 10)
            for name, (url, headers) in paths.items():
                events = asyncio.run(drive_rate(url, args.rate, n, headers))
                at_rate[name] = [e["ttft_ms"] for e in events if e["status"] == "ok"]
    finally:
        gateway.terminate()
        nginx.terminate()
        gateway.wait(timeout=10)
        nginx.wait(timeout=10)

    figures: dict[str, dict[str, float]] = {}
    for name, res in results.items():
        figures[name] = {
            "requests": res["n"],
            "ok": res["ok"],
            "req_per_s": res["ok"] / res["s"],
            "ttft_p50_ms": percentile(res["ttft"], 50),
            "ttft_p99_ms": percentile(res["ttft"], 99),
            "ttft_mean_ms": statistics.fmean(res["ttft"]),
        }
        f = figures[name]
        print(
            f"{name:8s} {f['ok']:6.0f}/{f['requests']:.0f} ok  {f['req_per_s']:8.1f} req/s  "
            f"TTFT p50 {f['ttft_p50_ms']:7.3f} ms  p99 {f['ttft_p99_ms']:7.3f} ms"
        )
    direct, proxied = figures["direct"], figures["gateway"]
    out = {
        "metric": "gateway_ttft_p50_ms",
        "ours": round(proxied["ttft_p50_ms"], 3),
        "reference": round(direct["ttft_p50_ms"], 3),
        "ratio": round(proxied["ttft_p50_ms"] / direct["ttft_p50_ms"], 3),
        "added_ms_p50": round(proxied["ttft_p50_ms"] - direct["ttft_p50_ms"], 3),
        "added_ms_p99": round(proxied["ttft_p99_ms"] - direct["ttft_p99_ms"], 3),
        "throughput_fraction": round(proxied["req_per_s"] / direct["req_per_s"], 3),
        "concurrency": args.concurrency,
        "cpus": os.cpu_count(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    if args.rate > 0 and all(at_rate.values()):
        d50, g50 = percentile(at_rate["direct"], 50), percentile(at_rate["gateway"], 50)
        d99, g99 = percentile(at_rate["direct"], 99), percentile(at_rate["gateway"], 99)
        print(
            f"open loop at {args.rate:g} req/s: TTFT p50 direct {d50:.3f} ms, gateway "
            f"{g50:.3f} ms; p99 direct {d99:.3f} ms, gateway {g99:.3f} ms"
        )
        out.update(
            rate=args.rate,
            added_ms_p50_at_rate=round(g50 - d50, 3),
            added_ms_p99_at_rate=round(g99 - d99, 3),
        )
    failed = any(f["ok"] < f["requests"] for f in figures.values())
    print(json.dumps(out))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
