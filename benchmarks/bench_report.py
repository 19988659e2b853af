"""How long `report build RUN --vs BASE --format json` takes, and its peak memory, on a store of
1,000,000 events over two runs (`--events`: 10,000,000 is a long-lived server's week at ~16
requests/s; the store takes ~90 MB per million events and about half a minute per million to
fill), against the bare DuckDB query computing the same overall percentiles, in the same run.

The store is a real servescope DuckDB file filled through the store's own bulk ingestion (the
path `servescope collect` uses) with bench-shaped events: TTFT, TPOT, e2e, ITL gaps, tokens,
cached tokens, 1 % errors, two workloads at three concurrency levels, plus a lever flip and
server counters, so every part of the report does real work.

    ours       wall time of the `report build … --vs … --format json` command (a new process,
               interpreter start-up included)
    reference  one bare DuckDB query (`REFERENCE_SQL`: count, errors, p50/p90/p95/p99/mean of
               TTFT, TPOT, e2e and queue time, tokens) for both runs, in this process on a
               connection opened beforehand
    Both are timed --repeats times, interleaved so they share the machine's load; best of each.

The last line is JSON: {"metric": "report_build_s", "ours": X, "reference": Y, "ratio": X/Y,
"peak_rss_mb": Z} (the report process's own high-water mark, VmHWM).
Targets: ratio ≤ 5 and the report process's peak RSS ≤ 1 GiB, at 10,000,000 events too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import duckdb
import numpy as np
from rich.progress import Progress

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from servescope.store import Store  # noqa: E402
from servescope.store.bulk import ingest_lines  # noqa: E402

RUNS = ("run-20261122-bench-off", "run-20261122-bench-on")
T0 = datetime(2026, 11, 22, 0, 0, 0)
CHUNK = 100_000
# The reference: one plain aggregate, per latency its quantiles and mean over successful requests.
_OK = "FILTER (WHERE status = 'ok')"
_LATENCIES = ",\n    ".join(
    f"{aggregate} {_OK}"
    for metric in ("ttft_ms", "tpot_ms", "e2e_ms", "queue_ms")
    for aggregate in [*(f"quantile_cont({metric}, {q})" for q in (0.5, 0.9, 0.95, 0.99)),
                      f"avg({metric})"]
)  # fmt: skip
REFERENCE_SQL = f"""
SELECT
    count(*),
    count(*) FILTER (WHERE status <> 'ok'),
    {_LATENCIES},
    sum(prompt_tokens),
    sum(completion_tokens)
FROM events WHERE run_id = ?
"""  # noqa: S608 - fixed column names, no input


def event_chunks(
    run_id: str, n: int, seed: int, ttft_divisor: float, start: datetime
) -> Iterator[bytes]:
    """n bench-shaped events of one run as `.events.jsonl` bytes, CHUNK lines at a time (the
    draws are made for the whole run first, so the data does not depend on the chunking; only
    one chunk's text is held at once, which lets the store be filled at 10 M events)."""
    rng = np.random.default_rng(seed)
    ttft = rng.lognormal(5.3, 0.4, n) / ttft_divisor
    tpot = rng.normal(30.0, 5.0, n).clip(1.0)
    gaps = rng.normal(30.0, 5.0, (n, 7)).clip(0.5).round(3)
    cached = rng.integers(0, 512, n)
    failed = rng.random(n) < 0.01
    step_ms = 3_600_000 / n  # one hour of traffic
    levels = (1, 4, 16)
    for first in range(0, n, CHUNK):
        lines = []
        for i in range(first, min(first + CHUNK, n)):
            ts = (start + timedelta(milliseconds=i * step_ms)).isoformat() + "Z"
            workload = "short-short" if i % 2 else "long-short"
            concurrency = levels[(i * 3) // n]
            head = (
                f'{{"request_id":"{run_id}-{i + 1:07d}","run_id":"{run_id}","ts":"{ts}",'
                f'"source":"client","model":"tiny","workload":"{workload}",'
                f'"concurrency":{concurrency},"prompt_tokens":512'
            )
            if failed[i]:
                lines.append(
                    head + f',"e2e_ms":{ttft[i]:.3f},"status":"error","error":"http_5xx",'
                    '"http_status":500,"finish_reason":"error"}\n'
                )
                continue
            e2e = ttft[i] + tpot[i] * 7
            itl = ",".join(f"{g:g}" for g in gaps[i])
            lines.append(
                head + f',"completion_tokens":8,"cached_tokens":{cached[i]},'
                f'"ttft_ms":{ttft[i]:.3f},"tpot_ms":{tpot[i]:.3f},"e2e_ms":{e2e:.3f},'
                f'"itl_ms":[{itl}],"status":"ok","finish_reason":"length"}}\n'
            )
        yield "".join(lines).encode()


def build_store(path: Path, total: int) -> None:
    store = Store(path)
    per_run = total // len(RUNS)
    with Progress() as progress:
        task = progress.add_task("filling the store", total=total)
        for k, run_id in enumerate(RUNS):
            start = T0 + timedelta(hours=2 * k)
            offset = 0
            for chunk in event_chunks(run_id, per_run, seed=k, ttft_divisor=1 + 4 * k, start=start):
                with store.write() as con:
                    result = ingest_lines(store, con, chunk, source=run_id, offset=offset)
                assert not result.errors, result.errors[:3]
                offset += len(chunk)
                progress.advance(task, result.lines)
            spec = {"workloads": [{"name": "short-short"}, {"name": "long-short"}], "seed": 0}
            store.upsert_run(
                run_id,
                started_at=start,
                ended_at=start + timedelta(hours=1),
                model="tiny",
                vllm_version="0.32.0",
                levers={"enable_prefix_caching": bool(k)},
                workload=spec,
            )
            samples = []
            for minute in range(61):
                ts = start + timedelta(minutes=minute)
                hits = minute * 1000.0 * k * 0.9
                samples += [
                    (ts, "vllm", "vllm:prefix_cache_hits_total", {}, run_id, hits),
                    (ts, "vllm", "vllm:prefix_cache_queries_total", {}, run_id, minute * 1000.0),
                    (ts, "vllm", "vllm:kv_cache_usage_perc", {}, run_id, 0.3 + 0.005 * minute),
                ]
            store.add_metric_samples(samples)
        store.add_lever_flip(
            "enable_prefix_caching", "false", "true", run_id=RUNS[1], ts=T0 + timedelta(hours=2)
        )


def reference_s(path: Path) -> float:
    """One timing of the bare DuckDB query for the same overall percentiles (both runs), on a
    connection opened beforehand."""
    con = duckdb.connect(str(path), read_only=True)
    try:
        started = time.perf_counter()
        for run_id in RUNS:
            con.execute(REFERENCE_SQL, [run_id]).fetchall()
        return time.perf_counter() - started
    finally:
        con.close()


def _peak_rss(pid: int) -> int:
    """VmHWM of a running process: the high-water mark of its own memory since exec, in bytes.

    (`wait4`'s ru_maxrss would also count this benchmark's own memory, inherited at fork.)"""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def ours_s(path: Path, out: Path) -> tuple[float, int]:
    """One timing of the command (a new process) and its peak RSS in bytes."""
    command = [
        str(Path(sys.executable).with_name("report")), "build", RUNS[1], "--vs", RUNS[0],
        "--format", "json", "--store", str(path), "--out", str(out),
    ]  # fmt: skip
    # the code measured is this checkout's, wherever the venv's editable install points
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    peak = 0
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    while process.poll() is None:  # VmHWM only grows: the last reading is the peak
        peak = max(peak, _peak_rss(process.pid))
        time.sleep(0.01)
    elapsed = time.perf_counter() - started
    if process.returncode != 0:
        assert process.stderr is not None
        raise SystemExit(f"report build failed:\n{process.stderr.read().decode()}")
    return elapsed, peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--keep", type=Path, help="build the store here and keep it")
    args = parser.parse_args()
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        return measure(args.keep, args)
    with tempfile.TemporaryDirectory(prefix="bench-report-") as tmp:  # ~90 MB/M events: not kept
        return measure(Path(tmp), args)


def measure(folder: Path, args: argparse.Namespace) -> int:
    path = folder / "bench.duckdb"
    if not path.exists():
        started = time.perf_counter()
        build_store(path, args.events)
        print(f"store: {args.events:,} events in {time.perf_counter() - started:.1f} s ({path})")
    # interleaved (reference, ours, reference, ours, …) so both see the same machine load;
    # the best of each is reported
    reference, ours, rss = float("inf"), float("inf"), 0
    for _ in range(args.repeats):
        reference = min(reference, reference_s(path))
        elapsed, peak = ours_s(path, folder / "reports")
        ours, rss = min(ours, elapsed), max(rss, peak)
    print_timing(
        folder / "reports" / f"{RUNS[1]}-vs-{RUNS[0]}",
        reference=("bare DuckDB overall percentiles, 2 runs", reference),
        ours=("report build --vs --format json, new process", ours),
        rss=rss,
    )
    print(f"ratio: {ours / reference:.2f} (target ≤ 5)")
    print(json.dumps({"metric": "report_build_s", **versus(ours, reference),
                      "peak_rss_mb": round(rss / 2**20, 1)}))  # fmt: skip
    return 0


def print_timing(
    report: Path, *, reference: tuple[str, float], ours: tuple[str, float], rss: int
) -> None:
    """The diff report's headline, the reference's and our best times (each with what it
    timed) and our peak RSS: what this benchmark and bench_lake.py print alike."""
    print(f"headline: {json.loads((report / 'report.json').read_text())['headline']}")
    print(f"reference ({reference[0]}): {reference[1]:.3f} s")
    print(f"ours ({ours[0]}): {ours[1]:.3f} s")
    print(f"report process peak RSS: {rss / 2**20:.0f} MiB (target ≤ 1024 MiB)")


def versus(ours: float, reference: float) -> dict[str, float]:
    """Our best time against the reference's, as the last line gives them."""
    return {"ours": round(ours, 4), "reference": round(reference, 4),
            "ratio": round(ours / reference, 3)}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
