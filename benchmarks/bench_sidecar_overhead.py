"""bench_sidecar_overhead.py — what watching vLLM costs it: output throughput and TTFT p50 at
saturation with the collector sidecar attached (log tail, 1 s /metrics scrapes, OTLP traces
received and stored, GPU telemetry) against the same server without it, in one sitting,
rounds alternating. Prints one JSON line: the ratio of throughputs and the TTFT p50 delta
(attached − detached), with every round's figures.

How it alternates, and why. Trace export is a vLLM start flag, so the two arms cannot differ
in it without a restart, and a restart (~90 s on an H100) between every round would let the
compile cache, the GPU's clocks and temperature differ more than the sidecar does. So:

1. One server, started with `--otlp-traces-endpoint` at a fixed port, serves every round.
   Rounds alternate A B B A A B … (so a slow drift of the machine falls on both arms): in an
   *attached* round `servescope collect` owns the port (it tails the log, scrapes /metrics
   every second, receives and stores the traces, samples the GPU); in a *detached* round a
   null sink owns it, answering every export with 200 and keeping nothing. The difference is
   the sidecar's whole cost to the server: its reads, its scrapes, its answers to vLLM's
   exporter, its CPU beside vLLM's processes.
2. Then (unless `--no-untraced`) the server is restarted without tracing and runs two rounds
   with nothing attached: vLLM's own cost of exporting spans, the part the sidecar asks of
   vLLM, measured across one restart (stated in the output as `tracing_export`).

The load is `servescope bench run` with a saturating workload (default `gpu-saturate`: 256
streams), the same client in both arms; throughput is output tokens ÷ the round's span, TTFT
p50 the client's. On a CPU machine: `--profile default --model servescope-data/models/tiny
--config seed-lab10 --workload short-short --requests 32`.
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from servescope.loadgen.launcher import VllmServer
from servescope.store import Store
from servescope.store.settings import free_port, listening


class NullSink(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP endpoint that accepts every export and keeps nothing (detached rounds)."""

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_args: object) -> None:
        return


class Arm:
    """Who owns the OTLP port during a round: the collector (attached) or the null sink."""

    def __init__(self, attached: bool, port: int, server: VllmServer, store: Path) -> None:
        self.attached, self.port, self.server, self.store = attached, port, server, store
        self.proc: subprocess.Popen[bytes] | None = None
        self.sink: http.server.ThreadingHTTPServer | None = None

    def __enter__(self) -> Arm:
        if self.attached:
            command = [sys.executable, "-m", "servescope.cli", "collect",
                       "--vllm-log", str(self.server.log_path), "--otlp-port", str(self.port),
                       "--metrics-url", f"{self.server.url}/metrics", "--scrape-interval", "1",
                       "--metrics-port", "0", "--store", str(self.store)]  # fmt: skip
            out = self.store.with_suffix(".collector.log").open("ab")
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 60
            while not listening(self.port):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the collector did not start")
                time.sleep(0.2)
        else:
            self.sink = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), NullSink)
            threading.Thread(target=self.sink.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.sink is not None:
            self.sink.shutdown()
            self.sink.server_close()


def bench_round(args: argparse.Namespace, url: str, run_id: str, store: Path) -> dict[str, Any]:
    """One saturating run of the bench client; its output throughput and TTFT p50."""
    command = [sys.executable, "-m", "servescope.cli", "bench", "run", "--config", args.config,
               "--target", url, "--run-id", run_id, "--store", str(store)]  # fmt: skip
    for workload in args.workload or []:
        command += ["--workload", workload]
    if args.requests:
        command += ["--requests", str(args.requests)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode not in (0, 1):
        raise RuntimeError(f"bench run failed: {done.stderr[-2000:]}")
    with Store(store).read() as con:  # waits out the attached collector's flushes
        row = con.execute(
            """
            SELECT sum(completion_tokens) FILTER (WHERE status = 'ok'),
                   epoch(max(ts + to_milliseconds(e2e_ms))) - epoch(min(ts)),
                   quantile_cont(ttft_ms, 0.5) FILTER (WHERE status = 'ok'),
                   count(*) FILTER (WHERE status <> 'ok')
            FROM events WHERE run_id = $run
            """,
            {"run": run_id},
        ).fetchone()
    assert row is not None
    tokens, seconds, ttft, failed = row
    return {"run_id": run_id, "output_tokens_per_s": tokens / seconds if seconds else None,
            "ttft_ms_p50": ttft, "failed": failed}  # fmt: skip


def order(rounds: int) -> list[bool]:
    """A B B A A B …: True = attached."""
    out: list[bool] = []
    for pair in range(rounds):
        out += [True, False] if pair % 2 == 0 else [False, True]
    return out


def summary(results: list[dict[str, Any]], attached: bool) -> dict[str, float | None]:
    mine = [r for r in results if r["attached"] == attached]
    tput = [r["output_tokens_per_s"] for r in mine if r["output_tokens_per_s"]]
    ttft = [r["ttft_ms_p50"] for r in mine if r["ttft_ms_p50"] is not None]
    return {"output_tokens_per_s": statistics.mean(tput) if tput else None,
            "ttft_ms_p50": statistics.median(ttft) if ttft else None}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--profile", default="gpu-bench")
    parser.add_argument("--config", default="gpu-saturate", help="the bench workload")
    parser.add_argument("--workload", action="append", help="only these workloads of it")
    parser.add_argument("--requests", type=int, help="requests per level and round")
    parser.add_argument("--pairs", type=int, default=3, help="attached/detached pairs")
    parser.add_argument(
        "--no-untraced", action="store_true", help="skip the restart without tracing"
    )
    parser.add_argument("--work", type=Path, help="folder for logs and stores (kept)")
    args = parser.parse_args()  # fmt: skip
    work = args.work or Path(tempfile.mkdtemp(prefix="overhead-"))
    work.mkdir(parents=True, exist_ok=True)
    otlp = free_port()
    env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    traced = VllmServer(args.model, profile=args.profile, port=free_port(), env=env,
                        extra_flags=["--otlp-traces-endpoint", f"http://127.0.0.1:{otlp}/v1/traces"],
                        log_path=work / "vllm-traced.log")  # fmt: skip
    results: list[dict[str, Any]] = []
    with NullSinkDuringStart(otlp):  # vLLM's warm-up spans go somewhere
        traced.start()
    try:
        for i, attached in enumerate(order(args.pairs), start=1):
            store = work / f"round-{i:02d}-{'attached' if attached else 'detached'}.duckdb"
            with Arm(attached, otlp, traced, store):
                found = bench_round(args, traced.url, f"overhead-{i:02d}", store)
            results.append({**found, "attached": attached})
            print(json.dumps({"round": i, **results[-1]}), file=sys.stderr, flush=True)
    finally:
        traced.stop()
    untraced: list[dict[str, Any]] = []
    if not args.no_untraced:
        with VllmServer(args.model, profile=args.profile, port=free_port(),
                        log_path=work / "vllm-untraced.log") as bare:  # fmt: skip
            for i in range(2):
                store = work / f"untraced-{i + 1}.duckdb"
                untraced.append(bench_round(args, bare.url, f"untraced-{i + 1:02d}", store))
    on, off = summary(results, True), summary(results, False)
    ratio = (on["output_tokens_per_s"] / off["output_tokens_per_s"]
             if on["output_tokens_per_s"] and off["output_tokens_per_s"] else None)  # fmt: skip
    both = on["ttft_ms_p50"] is not None and off["ttft_ms_p50"] is not None
    ttft_delta = on["ttft_ms_p50"] - off["ttft_ms_p50"] if both else None  # type: ignore[operator]
    bare_tput = [r["output_tokens_per_s"] for r in untraced if r["output_tokens_per_s"]]
    print(json.dumps({
        "bench": "sidecar_overhead", "profile": args.profile, "model": str(args.model),
        "pairs": args.pairs, "attached": on, "detached": off,
        "throughput_ratio": ratio,
        "throughput_delta_pct": (ratio - 1) * 100 if ratio is not None else None,
        "ttft_p50_delta_ms": ttft_delta,
        "tracing_export": {
            "untraced_output_tokens_per_s": statistics.mean(bare_tput) if bare_tput else None,
            "traced_detached_vs_untraced": (off["output_tokens_per_s"] / statistics.mean(bare_tput)
                                            if bare_tput and off["output_tokens_per_s"] else None),
            "note": "across one restart, not alternated",
        } if untraced else None,
        "rounds": results, "untraced_rounds": untraced, "work": str(work),
    }), flush=True)  # fmt: skip
    return 0


class NullSinkDuringStart(contextlib.AbstractContextManager):
    """vLLM exports its first spans while it warms up: a null sink holds the port while it
    starts (so neither arm inherits a backlog of retried exports)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sink: http.server.ThreadingHTTPServer | None = None

    def __enter__(self) -> NullSinkDuringStart:
        self.sink = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), NullSink)
        threading.Thread(target=self.sink.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.sink is not None:
            self.sink.shutdown()
            self.sink.server_close()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
