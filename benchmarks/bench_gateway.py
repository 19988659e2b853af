"""What the gateway costs: the same instant server reached directly and through the gateway.

The instant server is nginx returning a canned SSE completion of 16 chunks (plus usage and
`[DONE]`), so every millisecond measured is the client's or the gateway's own. The gateway runs
as a user runs it (`servescope gateway --config …`), in its own process, with one team whose
limits never bind (events and metrics on), so the figures are the proxy's cost, not admission's.
Both paths are driven by the load generator's streaming client (`loadgen.client.stream_request`
over `loadgen.transport.Http1Pool`), in the same run, so machine noise hits both alike. Two
measurements, because "concurrency 100" means two different things:

- Throughput, closed loop: 100 requests kept in flight on each path in turn, in short
  interleaved rounds (8 × 1,000 requests per path: direct, gateway, direct, gateway…, on
  keep-alive sessions opened once, after a warm-up), so a burst of other work on the machine
  falls on both paths alike. This saturates the slower process, so it gives the proxied ÷
  direct request rate. Its TTFTs are reported too, but they are not the latency the
  gateway adds: with 100 in flight, latency = 100 / throughput (Little's law), so they measure
  queueing behind whichever process is slower, a throughput figure in disguise.
- Added latency, below saturation: 100 open keep-alive connections per path and Poisson
  arrivals (seeded) at `--rate` requests/s on each path, both paths at the same time from one
  client, well below either path's capacity. A request then waits for the path itself, so the
  difference of the TTFT percentiles is what a user of a gateway that is not overloaded pays.
  Poisson rather than evenly spaced arrivals: bursts are what users send.

    .venv/bin/python benchmarks/bench_gateway.py [--concurrency 100] [--rounds 8] [--rate 200]
    .venv/bin/python benchmarks/bench_gateway.py --server uvicorn   # the same gateway on uvicorn

    .venv/bin/python benchmarks/bench_gateway.py --vs-aiohttp-client   # its upstream client

`--pool 2` puts a pool of two replicas behind the gateway (nginx listening on two ports, the
model routed by `--routing`, default prefix-affinity: every request here has the same prompt, so
the ring walk and the load bound run on every request — the dearest path). The direct path still
goes to one of them.

`--server uvicorn` serves the gateway's routes on uvicorn (httptools, uvloop) through a raw ASGI
adapter (benchmarks/gateway_asgi.py) instead of its own `gateway/httpserver.py`: what the home-made
server saves, measured.

`--vs-aiohttp-client` adds a third path, a second gateway whose proxy path uses aiohttp's client
(benchmarks/gateway_aiohttp_upstream.py) instead of its own `gateway/upstream.py`, driven in the
same interleaved rounds and the same open loop: `upstream_client` in the JSON holds both
gateways' CPU per request, closed-loop rate and added TTFT, and our ÷ aiohttp's ratios.

Last line (JSON): `ours` / `reference` = TTFT p50 through the gateway / direct below saturation,
`added_ms_p50` / `added_ms_p99` = their difference at p50 / p99, `throughput_fraction` =
proxied ÷ direct closed-loop rate; `closed_loop` holds the saturated figures. Targets: added
p50 ≤ 1 ms, p99 ≤ 5 ms, fraction ≥ 0.5. Exit 1 when a request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
from rich.progress import Progress

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from servescope.loadgen.client import stream_request  # noqa: E402
from servescope.loadgen.transport import Http1Pool  # noqa: E402
from servescope.store.settings import free_port  # noqa: E402
from servescope.wire.stream import COMPLETIONS  # noqa: E402

KEY = "sk-bench-gateway"
CHUNKS = 16


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


def start_nginx(folder: Path, port: int, more: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
    """nginx in the foreground, one process, our own config and temp dirs; `more` ports are
    the same instant server again (the replicas of a pool)."""
    body = canned_sse().replace("'", "\\'")
    conf = folder / "nginx.conf"
    listens = "\n".join(f"    listen 127.0.0.1:{p} backlog=4096;" for p in (port, *more))
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
{listens}
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


# How each gateway variant starts (`servescope gateway`, or a benchmark entry point)
GATEWAYS = {
    "http1": [sys.executable, "-m", "servescope.cli", "gateway"],
    "uvicorn": [sys.executable, str(ROOT / "benchmarks" / "gateway_asgi.py")],
    "aiohttp-client": [sys.executable, str(ROOT / "benchmarks" / "gateway_aiohttp_upstream.py")],
}


def start_gateway(
    folder: Path,
    port: int,
    upstream_ports: list[int],
    server: str = "http1",
    routing: str = "prefix-affinity",
) -> subprocess.Popen[bytes]:
    folder.mkdir(parents=True, exist_ok=True)
    names = [f"instant{i}" if i else "instant" for i in range(len(upstream_ports))]
    doc: dict[str, Any] = {
        "events_dir": str(folder / "events"),
        "upstreams": {
            name: {"url": f"http://127.0.0.1:{p}", "model": "instant", "max_concurrent": 10000}
            for name, p in zip(names, upstream_ports, strict=True)
        },
        "teams": {"bench": {"keys": [KEY], "max_concurrent": 10000, "max_queue": 10000}},
    }
    if len(names) > 1:
        doc["models"] = {"instant": {"pool": names, "routing": routing}}
    config = folder / "gateway.yaml"
    config.write_text(json.dumps(doc))
    log = (folder / "gateway.log").open("wb")
    proc = subprocess.Popen(
        [*GATEWAYS[server], "--config", str(config), "--port", str(port)],
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
    session: Http1Pool,
    base_url: str,
    concurrency: int,
    requests: int,
    headers: dict[str, str],
    advance: Any,
) -> tuple[list[dict[str, Any]], float]:
    """Closed loop: `concurrency` workers send `requests` streaming requests in all."""
    payload = {"model": "instant", "prompt": "x", "max_tokens": CHUNKS}
    events: list[dict[str, Any]] = []
    counter = iter(range(requests))

    async def worker() -> None:
        for seq in counter:
            event = await stream_request(
                session, base_url, COMPLETIONS, payload, f"bench-gw-{seq:06d}", headers=headers
            )
            events.append(event)
            advance()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return events, time.perf_counter() - start


async def closed_rounds(
    paths: dict[str, tuple[str, dict[str, str]]],
    concurrency: int,
    requests: int,
    rounds: int,
    progress: Any,
) -> dict[str, dict[str, Any]]:
    """Warm-up, then `rounds` × (each path in turn, `requests` each) on keep-alive sessions
    opened once, so short rounds interleave the paths finely without reconnecting."""
    results: dict[str, dict[str, Any]] = {p: {"ttft": [], "ok": 0, "n": 0, "s": 0.0} for p in paths}
    sessions = {name: Http1Pool(url) for name, (url, _headers) in paths.items()}
    try:
        warm = progress.add_task("warm-up", total=len(paths) * 500)
        for name, (url, headers) in paths.items():
            await drive(
                sessions[name], url, concurrency, 500, headers, lambda: progress.advance(warm)
            )
        task = progress.add_task("closed loop", total=len(paths) * rounds * requests)
        for _ in range(rounds):
            for name, (url, headers) in paths.items():
                events, elapsed = await drive(
                    sessions[name], url, concurrency, requests, headers,
                    lambda: progress.advance(task),
                )  # fmt: skip
                res = results[name]
                ok = [e for e in events if e["status"] == "ok" and "ttft_ms" in e]
                res["ttft"] += [e["ttft_ms"] for e in ok]
                res["ok"] += len(ok)
                res["n"] += len(events)
                res["s"] += elapsed
    finally:
        for pool in sessions.values():
            pool.close()
    return results


async def drive_open(
    paths: dict[str, tuple[str, dict[str, str]]],
    connections: int,
    rate: float,
    seconds: float,
    seed: int,
) -> dict[str, list[dict[str, Any]]]:
    """Open loop on every path at once: `connections` keep-alive connections opened per path
    first, then seeded Poisson arrivals at `rate` requests/s per path for `seconds`. Below
    saturation, what a request waits for is the path itself, not the requests ahead of it."""
    payload = {"model": "instant", "prompt": "x", "max_tokens": CHUNKS}
    rng = random.Random(seed)
    arrivals: list[tuple[float, str]] = []
    for name in paths:
        t = rng.expovariate(rate)
        while t < seconds:
            arrivals.append((t, name))
            t += rng.expovariate(rate)
    arrivals.sort()
    sessions = {name: Http1Pool(url) for name, (url, _headers) in paths.items()}
    try:

        def send(name: str, rid: str) -> Any:
            url, headers = paths[name]
            return stream_request(sessions[name], url, COMPLETIONS, payload, rid, headers=headers)

        await asyncio.gather(  # all connections opened (and kept: the pool holds `connections`)
            *(send(name, f"open-{name}-{i:06d}") for name in paths for i in range(connections))
        )
        tasks: dict[str, list[asyncio.Task[dict[str, Any]]]] = {name: [] for name in paths}
        start = time.perf_counter()
        for seq, (at, name) in enumerate(arrivals):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks[name].append(asyncio.create_task(send(name, f"rate-{seq:06d}")))
        return {name: list(await asyncio.gather(*ts)) for name, ts in tasks.items()}
    finally:
        for pool in sessions.values():
            pool.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


AIOHTTP_PATH = "gateway-aiohttp"  # the gateway with aiohttp's client on its proxy path


def upstream_client(
    closed: dict[str, dict[str, float]],
    below: dict[str, dict[str, float]],
    cpu_ms: dict[str, float],
) -> dict[str, Any]:
    """Our upstream client (`gateway`) against aiohttp's (`gateway-aiohttp`), same run: each
    one's gateway CPU per request, closed-loop rate and added TTFT below saturation, and the
    ratios ours ÷ aiohttp's (CPU and added TTFT: lower is better; rate: higher is better)."""
    ours, ref = "gateway", AIOHTTP_PATH

    def added(name: str, q: str) -> float:
        return round(below[name][f"ttft_{q}_ms"] - below["direct"][f"ttft_{q}_ms"], 3)

    sides = {
        side: {
            "cpu_ms_per_request": cpu_ms[name],
            "closed_loop_req_per_s": round(closed[name]["req_per_s"], 1),
            "added_ms_p50": added(name, "p50"),
            "added_ms_p99": added(name, "p99"),
        }
        for side, name in (("ours", ours), ("aiohttp", ref))
    }
    return {
        **sides,
        "reference": "aiohttp.ClientSession (the gateway's own connector settings)",
        "cpu_ratio": round(cpu_ms[ours] / cpu_ms[ref], 3),
        "throughput_ratio": round(closed[ours]["req_per_s"] / closed[ref]["req_per_s"], 3),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, default=100, help="requests in flight (closed "
                        "loop) and open connections per path (open loop)")  # fmt: skip
    parser.add_argument("--requests", type=int, default=1000, help="per path per closed round")
    parser.add_argument("--rounds", type=int, default=8, help="interleaved direct/gateway rounds")
    parser.add_argument("--rate", type=float, default=200.0, help="open loop: Poisson arrivals "
                        "per second on each path, well below both paths' capacity")  # fmt: skip
    parser.add_argument("--seconds", type=float, default=10.0, help="open loop duration")
    parser.add_argument("--seed", type=int, default=7, help="open loop arrival times")
    parser.add_argument(
        "--server",
        choices=["http1", "uvicorn"],
        default="http1",
        help="the gateway on its own HTTP/1.1 server (default) or on uvicorn + a raw ASGI app",
    )
    parser.add_argument(
        "--vs-aiohttp-client",
        action="store_true",
        help="also drive a gateway whose proxy path uses aiohttp's client (the reference for "
        "gateway/upstream.py), in the same rounds",
    )
    parser.add_argument("--pool", type=int, default=1, help="replicas behind the gateway")
    parser.add_argument(
        "--routing",
        choices=["round-robin", "least-outstanding", "prefix-affinity"],
        default="prefix-affinity",
        help="the pool's routing policy (with --pool > 1)",
    )
    return parser.parse_args()


def main() -> int:
    args = parse_args()

    load_start = os.getloadavg()[0]
    folder = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    nginx_port = free_port()
    replica_ports = [nginx_port, *(free_port() for _ in range(args.pool - 1))]
    nginx = start_nginx(folder, nginx_port, tuple(replica_ports[1:]))
    variants = {"gateway": args.server}
    if args.vs_aiohttp_client:
        variants[AIOHTTP_PATH] = "aiohttp-client"
    gateways: dict[str, subprocess.Popen[bytes]] = {}
    paths = {"direct": (f"http://127.0.0.1:{nginx_port}", {})}
    try:
        for name, server in variants.items():
            port = free_port()
            gateways[name] = start_gateway(folder / name, port, replica_ports, server, args.routing)
            paths[name] = (f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {KEY}"})
        processes = {name: psutil.Process(proc.pid) for name, proc in gateways.items()}
        with Progress(transient=True) as progress:
            cpu_before = {name: sum(p.cpu_times()[:2]) for name, p in processes.items()}
            results = asyncio.run(
                closed_rounds(paths, args.concurrency, args.requests, args.rounds, progress)
            )
            cpu_s = {  # warm-up included
                name: sum(p.cpu_times()[:2]) - cpu_before[name] for name, p in processes.items()
            }
            progress.add_task(f"open loop: {args.rate:g} req/s per path", total=None)
            opened = asyncio.run(
                drive_open(paths, args.concurrency, args.rate, args.seconds, args.seed)
            )
    finally:
        for proc in [*gateways.values(), nginx]:
            proc.terminate()
        for proc in [*gateways.values(), nginx]:
            proc.wait(timeout=10)

    closed: dict[str, dict[str, float]] = {}
    for name, res in results.items():
        closed[name] = {
            "requests": res["n"],
            "ok": res["ok"],
            "req_per_s": res["ok"] / res["s"],
            "ttft_p50_ms": percentile(res["ttft"], 50),
            "ttft_p99_ms": percentile(res["ttft"], 99),
            "ttft_mean_ms": statistics.fmean(res["ttft"]),
        }
        f = closed[name]
        print(
            f"closed loop, {args.concurrency} in flight: {name:15s} {f['ok']:6.0f}/"
            f"{f['requests']:.0f} ok {f['req_per_s']:8.1f} req/s  TTFT p50 "
            f"{f['ttft_p50_ms']:7.3f} ms  p99 {f['ttft_p99_ms']:7.3f} ms"
        )
    below: dict[str, dict[str, float]] = {}
    for name, events in opened.items():
        ttft = [e["ttft_ms"] for e in events if e["status"] == "ok" and "ttft_ms" in e]
        below[name] = {
            "requests": len(events),
            "ok": len(ttft),
            "ttft_p50_ms": percentile(ttft, 50),
            "ttft_p99_ms": percentile(ttft, 99),
        }
        f = below[name]
        print(
            f"open loop, {args.rate:g} req/s, {args.concurrency} connections: {name:15s} "
            f"{f['ok']:5.0f}/{f['requests']:.0f} ok  TTFT p50 {f['ttft_p50_ms']:7.3f} ms  "
            f"p99 {f['ttft_p99_ms']:7.3f} ms"
        )
    direct, proxied = below["direct"], below["gateway"]
    cpu_ms = {
        name: round(1000 * cpu_s[name] / (closed[name]["requests"] + 500), 4) for name in cpu_s
    }
    out = {
        "metric": "gateway_ttft_p50_ms",
        "server": args.server,
        "pool": args.pool,
        "routing": args.routing if args.pool > 1 else None,
        "ours": round(proxied["ttft_p50_ms"], 3),
        "reference": round(direct["ttft_p50_ms"], 3),
        "ratio": round(proxied["ttft_p50_ms"] / direct["ttft_p50_ms"], 3),
        "added_ms_p50": round(proxied["ttft_p50_ms"] - direct["ttft_p50_ms"], 3),
        "added_ms_p99": round(proxied["ttft_p99_ms"] - direct["ttft_p99_ms"], 3),
        "throughput_fraction": round(
            closed["gateway"]["req_per_s"] / closed["direct"]["req_per_s"], 3
        ),
        # the gateway process's CPU per proxied request in the closed loop (warm-up included):
        # what the proxy costs, whatever else the machine runs
        "gateway_cpu_ms_per_request": cpu_ms["gateway"],
        "concurrency": args.concurrency,
        "rate": args.rate,
        "closed_loop": {
            "direct_req_per_s": round(closed["direct"]["req_per_s"], 1),
            "gateway_req_per_s": round(closed["gateway"]["req_per_s"], 1),
            "ours": round(closed["gateway"]["ttft_p50_ms"], 3),
            "reference": round(closed["direct"]["ttft_p50_ms"], 3),
            "added_ms_p50": round(
                closed["gateway"]["ttft_p50_ms"] - closed["direct"]["ttft_p50_ms"], 3
            ),
            "added_ms_p99": round(
                closed["gateway"]["ttft_p99_ms"] - closed["direct"]["ttft_p99_ms"], 3
            ),
        },
        "upstream_client": upstream_client(closed, below, cpu_ms)
        if AIOHTTP_PATH in cpu_ms
        else None,
        "cpus": os.cpu_count(),
        "loadavg_1m": [round(load_start, 2), round(os.getloadavg()[0], 2)],  # at start, at end
    }
    failed = any(f["ok"] < f["requests"] for f in [*closed.values(), *below.values()])
    print(json.dumps(out))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
