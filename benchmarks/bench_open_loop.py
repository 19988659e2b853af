"""Benchmark: how late `bench run` sends an open loop's requests, against the timer itself.

An open loop sends each request at its seeded arrival time whatever the server does. The lag
of a send (sent − intended, `schedule_lag_ms` on every event) is the client's: its event loop
busy with other streams, or its process waiting for a CPU. This runs `servescope bench run`
with an open-loop workload at each rate of `--rates` against a running vLLM, and in the same
run, right after each, the reference: a bare asyncio loop that only sleeps to the same seeded
schedule and reads the clock (what any asyncio client gets from the timer alone). The figures
are each side's lag p50 and p99; the ratio is ours over the reference's p99, and the difference
is what the client adds to the timer. `bench run` flags a level `client_saturated` above 50 ms.

Usage: .venv/bin/python benchmarks/bench_open_loop.py --target http://127.0.0.1:8000
       [--rates 4,16,64] [--requests 64]
Last line: {"metric": "open_loop_schedule_lag_ms_p99", "rates": {...}, ...}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from servescope.loadgen.plan import open_loop_units  # noqa: E402
from servescope.loadgen.record import percentile  # noqa: E402
from servescope.loadgen.workload import load_config  # noqa: E402

WORKLOAD = """
workloads:
  - name: open-loop-lag
    input_tokens: {{dist: uniform, min: 16, max: 64}}
    output_tokens: 6
    rate: [{rate}]
    arrival: poisson
    requests_per_level: {requests}
    warmup: 1
    seed: 5
"""


def _ours(target: str, config: Path, store: Path, run_id: str) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", "servescope.cli", "bench", "run", "--config", str(config),
         "--target", target, "--run-id", run_id, "--store", str(store), "--json"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"bench run exited {result.returncode}: {result.stderr[-2000:]}")
    (level,) = json.loads(result.stdout)["levels"]
    return level


async def _timer(offsets: list[float]) -> list[float]:
    """The lag of a loop that does nothing but sleep to each offset, in ms."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    lags = []
    for offset in offsets:
        await asyncio.sleep(max(0.0, started + offset - loop.time()))
        lags.append((loop.time() - started - offset) * 1000.0)
    return lags


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="a running vLLM's base URL")
    parser.add_argument("--rates", default="4,16,64", help="requests per second, comma-separated")
    parser.add_argument("--requests", type=int, default=64, help="requests per rate")
    args = parser.parse_args()
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for rate in (float(r) for r in args.rates.split(",")):
            config = Path(folder) / f"open-{rate:g}.yaml"
            config.write_text(WORKLOAD.format(rate=rate, requests=args.requests))
            run_id = f"run-{time.strftime('%Y%m%d-%H%M%S')}-open-{rate:g}"
            level = _ours(args.target, config, Path(folder) / "store.duckdb", run_id)
            workload = load_config(config).workloads[0]
            offsets = sorted(u.offset_s or 0.0 for u in open_loop_units(workload, rate, 1.0))
            timer = asyncio.run(_timer(offsets))
            ours_p99 = level["schedule_lag_ms"]["p99"]
            timer_p99 = percentile(timer, 0.99)
            rows[f"{rate:g}"] = {
                "ours_p50": round(level["schedule_lag_ms"]["p50"], 3),
                "ours_p99": round(ours_p99, 3),
                "timer_p50": round(percentile(timer, 0.5), 3),
                "timer_p99": round(timer_p99, 3),
                "ratio_p99": round(ours_p99 / timer_p99, 1) if timer_p99 > 0 else None,
                "added_p99_ms": round(ours_p99 - timer_p99, 3),
                "achieved_rate": round(level["achieved_rate"], 2),
                "client_saturated": level["client_saturated"],
            }
            print(f"rate {rate:g}/s: {json.dumps(rows[f'{rate:g}'])}")
    print(json.dumps({"metric": "open_loop_schedule_lag_ms_p99", "requests": args.requests,
                      "rates": rows}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
