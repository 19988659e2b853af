"""Collector ingestion speed against DuckDB's own bulk JSON load, measured in the same run.

(a) ours: the collector tailing a file of N seed-format events (tailing mode, checkpoints
    committed with every flush, the store's primary key and merge rules in force), timed from
    start to the flush that commits the last event;
(b) reference: `CREATE TABLE t AS SELECT * FROM read_json_auto(file)` into a fresh DuckDB file
    (no key, no validation, no quarantine, no checkpoints).
And a floor: the same rows, already parsed and typed, copied from ours into a fresh store in one
transaction — what writing them costs with no reading, parsing or checking at all.
Then a steady-rate run: a writer appends events at `--rate` per second for `--seconds` while the
collector tails the file; end-to-end lag (line written → committed) per event, p50/p99, and the
process's peak RSS.

    .venv/bin/python benchmarks/bench_ingest.py            # 1,000,000 events, 5,000/s for 60 s
    .venv/bin/python benchmarks/bench_ingest.py --baseline 582e63a --rounds 4
    .venv/bin/python benchmarks/bench_ingest.py --baseline rules-off --rounds 8

The last line is JSON: {"metric": "ingest_events_per_s", "ours": X, "reference": Y, "ratio": X/Y}.
With `--baseline REF` it instead times (a) for the code at git REF (`rules-off`: this tree with
the input rules of issue 15 switched off, see `switch_rules_off`) and for this tree, in fresh
processes, alternately, on the same file: wall and CPU seconds each round, and the last line is
{"metric": "ingest_before_after", "before_s": …, "after_s": …, "before_cpu_s": …, …}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import duckdb
import psutil
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

ROOT = Path(__file__).resolve().parents[1]
# `--code-root DIR` (set by --baseline): import the collector and store of another tree
_CODE = sys.argv[sys.argv.index("--code-root") + 1] if "--code-root" in sys.argv else str(ROOT)
sys.path.insert(0, _CODE)

from servescope.collector import Collector, FlushReport  # noqa: E402
from servescope.collector.sources.events import EventsFiles  # noqa: E402
from servescope.store import Store  # noqa: E402
from servescope.store.lake import LakeWriter  # noqa: E402
from servescope.store.lakeread import Lake  # noqa: E402

console = Console(stderr=True)


def seed_line(i: int, rng: random.Random, run: str = "run-20260512") -> str:
    return json.dumps(
        {
            "request_id": f"{run}-{i:07d}",
            "model": "local-coder",
            "prompt_tokens": rng.randint(10, 4000),
            "completion_tokens": rng.randint(1, 800),
            "ttft_ms": rng.randint(20, 2000),
            "tpot_ms": rng.randint(5, 80),
            "cache_hit": rng.random() < 0.5,
            "finish_reason": "stop",
        }
    )


def write_file(path: Path, n: int) -> None:
    rng = random.Random(20260512)
    with path.open("w") as fh:
        for start in range(0, n, 10_000):
            fh.write(
                "".join(seed_line(i, rng) + "\n" for i in range(start, min(n, start + 10_000)))
            )


def reference(path: Path, folder: Path) -> float:
    db = folder / "reference.duckdb"
    started = time.perf_counter()
    con = duckdb.connect(str(db))
    con.execute("CREATE TABLE t AS SELECT * FROM read_json_auto(?)", [str(path)])
    con.close()
    elapsed = time.perf_counter() - started
    con = duckdb.connect(str(db), read_only=True)
    count = con.execute("SELECT count(*) FROM t").fetchone()
    con.close()
    assert count is not None and count[0] > 0
    return elapsed


def ours(path: Path, folder: Path, n: int, lake: bool = False) -> tuple[float, float | None]:
    """Seconds until the store has committed the last event; and, with a lake, until the lake
    holds it too (a flush's new requests are written to the lake after its commit)."""
    store = Store(folder / "ours.duckdb")
    store._ensure_schema()
    writer = LakeWriter(folder / "lake-ours", store) if lake else None
    collector = Collector(store, [EventsFiles(str(path))], lake=writer)
    written = {"n": 0}
    done = threading.Event()

    def count(report: FlushReport) -> None:
        written["n"] += report.events
        if written["n"] >= n:
            done.set()

    collector.exporters.append(count)
    stop = threading.Event()
    loop = threading.Thread(target=collector.run, args=(stop,), daemon=True)
    with _progress() as progress:
        task = progress.add_task("collector ingest", total=n)
        started = time.perf_counter()
        loop.start()
        while not done.wait(0.5):
            progress.update(task, completed=written["n"])
        elapsed = time.perf_counter() - started
        if writer is not None:
            writer.wait()
        in_lake = time.perf_counter() - started if writer is not None else None
        progress.update(task, completed=written["n"])
    stop.set()
    loop.join()
    with store.read() as con:
        row = con.execute("SELECT count(*) FROM events").fetchone()
    assert row is not None and row[0] == n, row
    if writer is not None:
        with Lake([writer.location]).read() as con:
            row = con.execute("SELECT count(*) FROM events").fetchone()
        assert row is not None and row[0] == n, row
    return elapsed, in_lake


def write_floor(folder: Path) -> float:
    """Seconds to insert the rows `ours` stored (held in memory, nothing left to compute) into a
    fresh store's `events` table and commit."""
    mem = duckdb.connect()
    mem.execute("ATTACH ? AS ours (READ_ONLY)", [str(folder / "ours.duckdb")])
    mem.execute("CREATE TABLE ready AS SELECT * FROM ours.events")
    mem.execute("DETACH ours")
    target = Store(folder / "floor.duckdb")
    target._ensure_schema()
    started = time.perf_counter()
    mem.execute("ATTACH ? AS floor", [str(target.path)])
    mem.execute("BEGIN")
    mem.execute("INSERT INTO floor.events SELECT * FROM ready")
    mem.execute("COMMIT")
    mem.execute("DETACH floor")
    elapsed = time.perf_counter() - started
    mem.close()
    return elapsed


def steady(folder: Path, rate: int, seconds: float, lake: bool = False) -> dict[str, float]:
    """Lag of each event from its write to its commit, at a steady rate; and peak RSS."""
    path = folder / "steady.events.jsonl"
    path.touch()
    store = Store(folder / "steady.duckdb")
    store._ensure_schema()
    writer = LakeWriter(folder / "lake-steady", store) if lake else None
    collector = Collector(store, [EventsFiles(str(path))], want_keys=True, lake=writer)
    total = int(rate * seconds)
    sent: list[float] = [0.0] * total
    lags: list[float] = []

    def on_flush(report: FlushReport) -> None:
        for _run, request_id in report.keys:
            lags.append(report.committed_at - sent[int(request_id.rsplit("-", 1)[1])])

    collector.exporters.append(on_flush)
    stop = threading.Event()
    loop = threading.Thread(target=collector.run, args=(stop,), daemon=True)
    loop.start()
    process = psutil.Process()
    peak = process.memory_info().rss
    rng = random.Random(1)
    tick = 0.01
    per_tick = max(1, int(rate * tick))
    with _progress() as progress, path.open("a") as fh:
        task = progress.add_task(f"steady {rate}/s", total=total)
        started = time.time()
        i = 0
        while i < total:
            due = started + (i / rate)
            if time.time() < due:
                time.sleep(min(tick, due - time.time()))
                continue
            batch = range(i, min(total, i + per_tick))
            now = time.time()
            fh.write("".join(seed_line(j, rng, "run-steady") + "\n" for j in batch))
            fh.flush()
            for j in batch:
                sent[j] = now
            i = batch.stop
            if i % rate < per_tick:
                peak = max(peak, process.memory_info().rss)
                progress.update(task, completed=i)
        progress.update(task, completed=total)
    deadline = time.time() + 30
    while len(lags) < total and time.time() < deadline:
        time.sleep(0.1)
        peak = max(peak, process.memory_info().rss)
    stop.set()
    loop.join()
    lags.sort()
    assert len(lags) == total, (len(lags), total)
    return {
        "events": total,
        "lag_p50_s": statistics.median(lags),
        "lag_p99_s": lags[int(0.99 * (len(lags) - 1))],
        "lag_max_s": lags[-1],
        "rss_peak_mb": peak / 2**20,
    }


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


def switch_rules_off() -> None:
    """This tree's bulk path without the input rules of issue 15, the reference for what they
    cost: no strict-JSON screen of ASCII pieces (others keep it: DuckDB refuses a file that is
    not UTF-8), and the statement's conditions as they were before the rules (types only: no
    range, finiteness or depth)."""
    from servescope.store import bulk, queries, schema_sql
    from servescope.store.validation import COUNTS, STATUSES

    def types_only() -> str:
        rid = "request_id::VARCHAR"
        conds = [
            f"starts_with({rid}, '\"') AND strlen({rid}) > 2 AND NOT contains({rid}, '\\')"
            f" AND strlen({rid}) = length({rid})",
            "(type IS NULL OR type::VARCHAR = '\"request\"')",
        ]
        for key, types in bulk.CONTRACT_TYPES.items():
            frag = f"{key}::VARCHAR"
            if key == "request_id":
                continue
            if key == "status":
                test = f"{frag} IN ({', '.join(repr(chr(34) + s + chr(34)) for s in STATUSES)})"
            elif types == (str,):
                test = f"starts_with({frag}, '\"')"
            elif key in COUNTS or key == "http_status":
                test = f"TRY_CAST({frag} AS BIGINT)::VARCHAR = {frag}"
            elif types == (bool,):
                test = f"{frag} IN ('true', 'false')"
            elif types == (list,):
                item = rf"\s*{bulk._DURATION}\s*"
                test = rf"regexp_full_match({frag}, '\[({item}(,{item})*|\s*)\]')"
            else:
                test = f"TRY_CAST({frag} AS DOUBLE) IS NOT NULL"
            conds.append(f"({key} IS NULL OR {test})")
        return "\n      AND ".join(conds)

    ok = types_only()
    bulk._INSERT = {  # type: ignore[attr-defined]
        key: queries.bulk_insert(schema_sql.event_columns(), key[0], ok) for key in bulk._INSERT
    }
    screen = bulk._screen

    def ascii_unscreened(piece: bytes, start: int, suspects: list[tuple[int, bytes]]) -> tuple:
        return ([piece], None) if piece.isascii() else screen(piece, start, suspects)

    bulk._screen = ascii_unscreened  # type: ignore[attr-defined]


def measure_once(path: Path, n: int, rules_off: bool) -> None:
    """`ours` alone in this process (the code of --code-root): one JSON line of wall and CPU s."""
    if rules_off:
        switch_rules_off()
    with tempfile.TemporaryDirectory(prefix="bench-ingest-once-") as tmp:
        cpu = time.process_time()
        wall, _in_lake = ours(path, Path(tmp), n)
        cpu = time.process_time() - cpu
    print(json.dumps({"wall_s": wall, "cpu_s": cpu}))


def before_after(ref: str, n: int, rounds: int) -> int:
    """(a) for the code at `ref` (or this tree with the input rules off: `rules-off`) and for
    this tree, alternately, each in a fresh process."""
    with tempfile.TemporaryDirectory(prefix="bench-ingest-ab-") as tmp:
        folder = Path(tmp)
        sides: dict[str, list[str]] = {"before": ["--code-root", str(ROOT), "--rules-off"]}
        if ref != "rules-off":
            before = folder / "before"
            before.mkdir()
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", ref, "store", "collector"],
                check=True,
                capture_output=True,
            ).stdout
            subprocess.run(["tar", "-x", "-C", str(before)], input=archive, check=True)
            sides["before"] = ["--code-root", str(before)]
        sides["after"] = ["--code-root", str(ROOT)]
        path = folder / "seed.events.jsonl"
        with console.status(f"writing {n:,} seed-format events"):
            write_file(path, n)
        runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
        for i in range(rounds):
            for side in ("before", "after")[:: 1 if i % 2 == 0 else -1]:
                load = os.getloadavg()[0]
                out = subprocess.run(
                    [sys.executable, __file__, "--measure-once", str(path)]
                    + ["--events", str(n), *sides[side]],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                result = {**json.loads(out.strip().splitlines()[-1]), "load": load}
                runs[side].append(result)
                print(
                    f"round {i + 1} {side:6s}: {result['wall_s']:.2f} s wall, "
                    f"{result['cpu_s']:.2f} CPU-s, load before {load:.2f}"
                )
    summary: dict[str, object] = {"metric": "ingest_before_after", "baseline": ref, "events": n}
    for side, results in runs.items():
        summary[f"{side}_s"] = round(statistics.median(r["wall_s"] for r in results), 3)
        summary[f"{side}_cpu_s"] = round(statistics.median(r["cpu_s"] for r in results), 3)
        summary[f"{side}_runs_s"] = [round(r["wall_s"], 3) for r in results]
        summary[f"{side}_runs_cpu_s"] = [round(r["cpu_s"], 3) for r in results]
    summary["after_over_before"] = round(summary["after_s"] / summary["before_s"], 3)  # type: ignore[operator]
    summary["after_over_before_cpu"] = round(
        summary["after_cpu_s"] / summary["before_cpu_s"],  # type: ignore[operator]
        3,
    )
    print(
        f"median of {rounds}: before {summary['before_s']} s ({summary['before_cpu_s']} CPU-s), "
        f"after {summary['after_s']} s ({summary['after_cpu_s']} CPU-s): "
        f"after/before {summary['after_over_before']} wall, {summary['after_over_before_cpu']} CPU"
    )
    print(json.dumps(summary))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--events", type=int, default=1_000_000, help="events in the bulk file")
    parser.add_argument("--rate", type=int, default=5000, help="steady-run events per second")
    parser.add_argument("--seconds", type=float, default=60.0, help="steady-run duration")
    parser.add_argument(
        "--baseline",
        metavar="REF",
        help="time the collector at git REF (or `rules-off`: this tree without the input rules)"
        " against this tree, alternately (no steady run)",
    )
    parser.add_argument("--rounds", type=int, default=4, help="rounds of --baseline (default 4)")
    parser.add_argument(
        "--lake",
        action="store_true",
        help="the collector also writes every flush to a Delta lake (`collect --lake`)",
    )
    parser.add_argument("--measure-once", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--code-root", help=argparse.SUPPRESS)
    parser.add_argument("--rules-off", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_once:
        measure_once(args.measure_once, args.events, args.rules_off)
        return 0
    if args.baseline:
        return before_after(args.baseline, args.events, args.rounds)
    with tempfile.TemporaryDirectory(prefix="bench-ingest-") as tmp:
        folder = Path(tmp)
        path = folder / "seed.events.jsonl"
        with console.status(f"writing {args.events:,} seed-format events"):
            write_file(path, args.events)
        size_mb = path.stat().st_size / 2**20
        # first: its RSS is the collector's own
        result = steady(folder, args.rate, args.seconds, args.lake)
        with console.status("reference: DuckDB read_json_auto bulk load"):
            ref_s = reference(path, folder)
        ours_s, in_lake_s = ours(path, folder, args.events, args.lake)
        with console.status("floor: the stored rows written again, nothing to parse"):
            floor_s = write_floor(folder)
    ours_rate = args.events / ours_s
    ref_rate = args.events / ref_s
    print(f"file: {args.events:,} events, {size_mb:.0f} MB")
    lake = " + lake" if args.lake else ""
    print(f"ours (collector, tailing, checkpoints on{lake}): {ours_s:.2f} s = {ours_rate:,.0f}/s")
    if in_lake_s is not None:
        print(f"  the lake holds the last event at {in_lake_s:.2f} s "
              f"(= {args.events / in_lake_s / ref_rate:.3f} x the reference)")  # fmt: skip
    print(f"reference (DuckDB read_json_auto):         {ref_s:.2f} s = {ref_rate:,.0f} events/s")
    print(
        f"floor (our rows alone, already parsed):    {floor_s:.2f} s = "
        f"{floor_s / ref_s:.2f} x the reference's whole load"
    )
    print(
        f"steady {args.rate}/s for {args.seconds:.0f} s: lag p50 {result['lag_p50_s']:.3f} s, "
        f"p99 {result['lag_p99_s']:.3f} s, max {result['lag_max_s']:.3f} s; "
        f"peak RSS {result['rss_peak_mb']:.0f} MB"
    )
    print(json.dumps({"metric": "steady_lag", "rate": args.rate, **result}))
    print(json.dumps({"metric": "events_write_floor_s", "floor": floor_s, "reference": ref_s}))
    print(
        json.dumps(
            {
                "metric": "ingest_events_per_s",
                "lake": args.lake,
                "ours": round(ours_rate, 1),
                "reference": round(ref_rate, 1),
                "ratio": round(ours_rate / ref_rate, 4),
                **(
                    {
                        "in_lake_s": round(in_lake_s, 3),
                        "in_lake_ratio": round(args.events / in_lake_s / ref_rate, 4),
                    }
                    if in_lake_s is not None
                    else {}
                ),  # fmt: skip
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
