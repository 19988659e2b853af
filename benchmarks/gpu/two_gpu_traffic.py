"""two_gpu_traffic.py BASE MODEL OUTDIR TAG [STREAMS] — the traffic of one recorded lifetime on a
GPU server: the operator's traffic of `operator_traffic.py` (20 good requests, 3 refused with
400), one prompt longer than the server's context (refused with 400), then, when STREAMS > 0,
STREAMS concurrent completions of 256 tokens while vLLM's `/metrics` is snapshotted about every
second (`OUTDIR/metrics-TAG-N.txt`: before, under load, after): under data parallelism those pages
carry the `engine` label of each engine. Prints one JSON line of what the client saw."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from operator_traffic import post

HERE = Path(__file__).resolve().parent
TOO_LONG = " ".join(f"w{i % 500}" for i in range(12000))


def snapshot(base: str, path: Path) -> None:
    """One `/metrics` page, as vLLM served it."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
        path.write_bytes(resp.read())


def main() -> int:
    try:
        return traffic()
    except OSError as exc:  # the server is gone or never came up: say so in the recording
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}", "argv": sys.argv[1:]}))
        return 1


def traffic() -> int:
    if len(sys.argv) < 5:
        print(__doc__, file=sys.stderr)
        return 2
    base, model, outdir, tag = sys.argv[1:5]
    streams = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    out = Path(outdir)
    operator = subprocess.run([sys.executable, str(HERE / "operator_traffic.py"), base, model],
                              capture_output=True, text=True, check=False)  # fmt: skip
    seen = json.loads(operator.stdout.strip().splitlines()[-1]) if operator.stdout.strip() else {}
    too_long = {"model": model, "prompt": TOO_LONG, "max_tokens": 8}
    long_status = post(base, "/v1/completions", too_long)
    result: dict[str, object] = {"tag": tag, "operator": seen, "too_long_prompt": long_status}
    if streams > 0:
        snapshot(base, out / f"metrics-{tag}-0-before.txt")
        body = {"model": model, "max_tokens": 256, "ignore_eos": True}
        words = [" ".join(f"w{(i * 7 + j) % 500}" for j in range(400)) for i in range(streams)]
        calls = [{**body, "prompt": f"stream {i}: {w}"} for i, w in enumerate(words)]
        done = threading.Event()
        statuses: list[int] = []

        def load() -> None:
            with ThreadPoolExecutor(streams) as pool:
                statuses.extend(pool.map(lambda b: post(base, "/v1/completions", b), calls))
            done.set()

        started = time.monotonic()
        threading.Thread(target=load, daemon=True).start()
        n = 0
        while not done.wait(1.0) and n < 5:
            n += 1
            snapshot(base, out / f"metrics-{tag}-{n}-load.txt")
        done.wait(300)
        snapshot(base, out / f"metrics-{tag}-{n + 1}-after.txt")
        by_status = {str(s): statuses.count(s) for s in sorted(set(statuses))}
        seconds = round(time.monotonic() - started, 2)
        result["load"] = {"streams": streams, "seconds": seconds, "by_status": by_status}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
