"""The shared lake (`collect --lake`, `--lake` on reading commands; store/lake.py), Delta tables.

Three sidecars (real `servescope collect` processes, each with its own store) tail their own
`.events.jsonl` streams into one lake while one of them is SIGKILLed and restarted mid-stream;
afterwards the lake holds every request exactly once, `report build --lake` equals the report
of one store that ingested all three streams, and three engines read the same counts and TTFT
quantiles with their own Delta readers and no rule of servescope's: DuckDB (over delta-rs'
Arrow dataset), ClickHouse (chdb's `deltaLakeLocal`) and Polars (`scan_delta`).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pytest
from deltalake import DeltaTable

from servescope.store import Store
from servescope.store.lakeread import Lake
from servescope.store.settings import free_port
from tests.helpers.cli import ROOT, SERVESCOPE
from tests.helpers.lake import (
    PER_SIDECAR,
    RUNS,
    SIDECARS,
    STEPS,
    wait_collector_up,
)


def _requests(sidecar: int) -> Iterator[bytes]:
    """One sidecar's stream: both runs' requests, every 10th completed by a second record a
    few steps later (a later flush merges it: a second version in the lake), a tool call now
    and then (runtime_events), and a line that is not JSON (ingest_errors, kept local)."""
    rng = random.Random(sidecar)
    late: list[tuple[int, bytes]] = []
    for i in range(PER_SIDECAR):
        run = RUNS[i % 2]
        rid = f"{run}-{sidecar}{i:05d}"
        ok = rng.random() > 0.03
        doc: dict[str, Any] = {
            "request_id": rid,
            "run_id": run,
            "ts": f"2026-11-25T10:{(i // 60) % 60:02d}:{i % 60:02d}.{sidecar}00Z",
            "source": "client",
            "model": "tiny",
            "workload": "chat",
            "concurrency": 4,
            "prompt_tokens": 100 + i % 50,
            "completion_tokens": 8,
            "ttft_ms": round(rng.lognormvariate(4.0, 0.5) / (1.3 if i % 2 else 1.0), 3),
            "tpot_ms": round(rng.uniform(5, 15), 3),
            "e2e_ms": round(rng.uniform(100, 300), 3),
            "itl_ms": [round(rng.uniform(5, 15), 3) for _ in range(7)],
            "status": "ok" if ok else "error",
        }
        if not ok:
            doc["error"] = "http_5xx"
        yield (json.dumps(doc) + "\n").encode()
        if i % 10 == 0:
            second = {"request_id": rid, "run_id": run, "cached_tokens": 64}
            late.append((i + 150, (json.dumps(second) + "\n").encode()))
        if i % 500 == 7:
            tool = {"type": "tool_call", "run_id": run, "ts": doc["ts"], "tool": f"t{i}"}
            yield (json.dumps(tool) + "\n").encode()
        if i % 1000 == 9:
            yield b"{not json\n"
        while late and late[0][0] <= i:
            yield late.pop(0)[1]
    for _at, line in late:
        yield line


def _start(events: Path, store: Path, lake: Path, out: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    process = subprocess.Popen(
        [*SERVESCOPE, "collect", "--events", str(events), "--store", str(store),
         "--lake", str(lake), "--metrics-port", str(port)],
        cwd=ROOT, stdout=out.open("ab"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    return process, port


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three sidecars, one lake; sidecar 1 SIGKILLed three times mid-stream."""
    tmp = tmp_path_factory.mktemp("fleet")
    lake = tmp / "lake"
    streams = [tmp / f"node{i}.events.jsonl" for i in range(SIDECARS)]
    stores = [tmp / f"node{i}.duckdb" for i in range(SIDECARS)]
    outs = [tmp / f"node{i}.out" for i in range(SIDECARS)]
    for path in streams:
        path.touch()
    procs = []
    for i in range(SIDECARS):
        proc, port = _start(streams[i], stores[i], lake, outs[i])
        wait_collector_up(proc, port, outs[i])
        procs.append([proc, port])
    lines = [list(_requests(i)) for i in range(SIDECARS)]
    done = threading.Event()

    def write() -> None:
        per = max(len(x) for x in lines) // STEPS + 1
        handles = [p.open("ab") for p in streams]
        for step in range(STEPS):
            for fh, mine in zip(handles, lines, strict=True):
                fh.write(b"".join(mine[step * per : (step + 1) * per]))
                fh.flush()
            time.sleep(0.1)
        for fh in handles:
            fh.close()
        done.set()

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    rng = random.Random(25)
    for _ in range(3):  # anywhere: between flushes, inside one, between lake and store
        time.sleep(rng.uniform(0.3, 1.0))
        procs[1][0].send_signal(signal.SIGKILL)
        procs[1][0].wait(timeout=30)
        procs[1] = list(_start(streams[1], stores[1], lake, outs[1]))
        wait_collector_up(procs[1][0], procs[1][1], outs[1])
    writer.join()
    assert done.is_set()
    time.sleep(2.0)  # the last lines flushed (a trickle flushes within 0.25 s)
    for (proc, _port), out in zip(procs, outs, strict=True):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, out.read_text(errors="replace")[-3000:]

    merged = tmp / "merged.duckdb"  # one store that ingested all three streams
    subprocess.run(
        [*SERVESCOPE, "collect", "--once", "--events", str(tmp / "node*.events.jsonl"),
         "--store", str(merged)],
        cwd=ROOT, check=True, capture_output=True,
    )  # fmt: skip
    return {"tmp": tmp, "lake": lake, "merged": merged, "stores": stores, "outs": outs}


def test_three_sidecars_one_killed_every_request_once(fleet: dict[str, Any]) -> None:
    lake: Path = fleet["lake"]
    raw = duckdb.connect()  # any Delta reader, no rule: the current version's rows
    raw.register("events", DeltaTable(str(lake / "events")).to_pyarrow_dataset())
    twice = raw.execute(
        "SELECT run_id, request_id, count(*) AS n FROM events GROUP BY ALL HAVING n <> 1"
    ).fetchall()
    assert twice == []
    with Lake([lake]).read() as con:
        total, distinct = con.execute(
            "SELECT count(*), count(DISTINCT (run_id, request_id)) FROM events"
        ).fetchone()
        lake_docs = con.execute(
            "SELECT run_id, request_id, doc FROM events ORDER BY 1, 2"
        ).fetchall()
        lake_tools = con.execute("SELECT count(*) FROM runtime_events").fetchone()
    assert total == distinct == SIDECARS * PER_SIDECAR
    with Store(fleet["merged"]).read() as con:
        store_docs = con.execute(
            "SELECT run_id, request_id, doc FROM events ORDER BY 1, 2"
        ).fetchall()
        store_tools = con.execute("SELECT count(*) FROM runtime_events").fetchone()
    assert lake_docs == store_docs  # the merged rows, second records included, byte for byte
    assert lake_tools == store_tools
    # the killed sidecar restarted from its checkpoints three times
    assert fleet["outs"][1].read_text().count("collector running") == 4
    # each sidecar's flushes reached the lake in order, each once (Delta's txn identifiers)
    apps = {
        t["appId"]: t["version"]
        for entry in DeltaTable(str(lake / "events")).history()
        for t in [entry.get("txn") or {}] if t
    }  # fmt: skip
    assert len(apps) <= SIDECARS


def _report(tmp: Path, where: list[str], name: str) -> dict[str, Any]:
    out = tmp / name
    subprocess.run(
        [*SERVESCOPE, "report", "build", RUNS[1], "--vs", RUNS[0], "--format", "json",
         "--out", str(out), *where],
        cwd=ROOT, check=True, capture_output=True,
    )  # fmt: skip
    return json.loads((out / f"{RUNS[1]}-vs-{RUNS[0]}" / "report.json").read_text())


def test_report_from_the_lake_equals_the_merged_store(fleet: dict[str, Any]) -> None:
    tmp: Path = fleet["tmp"]
    from_lake = _report(tmp, ["--lake", str(fleet["lake"])], "from-lake")
    from_store = _report(tmp, ["--store", str(fleet["merged"])], "from-store")
    assert from_lake["overall"]["requests"] == SIDECARS * PER_SIDECAR // 2
    for key in from_store:  # field by field, so a difference names its field
        assert from_lake[key] == from_store[key], key
    assert from_lake == from_store


def test_listing_commands_read_the_lake(fleet: dict[str, Any]) -> None:
    listed = subprocess.run(
        [*SERVESCOPE, "store", "runs", "--json", "--lake", str(fleet["lake"])],
        cwd=ROOT, check=True, capture_output=True, text=True,
    )  # fmt: skip
    stored = subprocess.run(
        [*SERVESCOPE, "store", "runs", "--json", "--store", str(fleet["merged"])],
        cwd=ROOT, check=True, capture_output=True, text=True,
    )  # fmt: skip
    assert json.loads(listed.stdout) == json.loads(stored.stdout)
    diagnosed = subprocess.run(
        [*SERVESCOPE, "diagnose", RUNS[1], "--json", "--lake", str(fleet["lake"])],
        cwd=ROOT, check=True, capture_output=True, text=True,
    )  # fmt: skip
    assert json.loads(diagnosed.stdout)["run_id"] == RUNS[1]
    missing = subprocess.run(
        [*SERVESCOPE, "report", "list", "--lake", str(fleet["tmp"] / "nowhere")],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert missing.returncode == 2 and "no lake at" in missing.stderr
    assert "Traceback" not in missing.stderr
    unknown = subprocess.run(
        [*SERVESCOPE, "report", "build", "run-nope", "--lake", str(fleet["lake"]),
         "--out", str(fleet["tmp"] / "nope")],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert unknown.returncode == 2 and all(run in unknown.stderr for run in RUNS)


def _expected(fleet: dict[str, Any]) -> dict[str, dict[str, Any]]:
    report = _report(fleet["tmp"], ["--lake", str(fleet["lake"])], "for-engines")
    out = {}
    for side, run in (("after", RUNS[1]), ("before", RUNS[0])):
        overall = report[side]["overall"]
        out[run] = {"requests": overall["requests"], "errors": overall["errors"],
                    "p50": overall["ttft_ms"]["p50"], "p95": overall["ttft_ms"]["p95"]}  # fmt: skip
    return out


def test_duckdb_reads_the_same_numbers(fleet: dict[str, Any]) -> None:
    """DuckDB over the Arrow dataset delta-rs makes of the current version (DuckDB's own
    `delta_scan` is an extension built for DuckDB 1.x only): `quantile_cont` is servescope's."""
    con = duckdb.connect()
    con.register("events", DeltaTable(str(fleet["lake"] / "events")).to_pyarrow_dataset())
    rows = con.execute(
        """SELECT run_id, count(*), count(*) FILTER (status != 'ok'),
                  quantile_cont(ttft_ms, 0.5) FILTER (status = 'ok'),
                  quantile_cont(ttft_ms, 0.95) FILTER (status = 'ok')
           FROM events GROUP BY run_id"""
    ).fetchall()
    got = {r: {"requests": n, "errors": e, "p50": p50, "p95": p95} for r, n, e, p50, p95 in rows}
    assert got == _expected(fleet)


def test_clickhouse_reads_the_same_numbers(
    fleet: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """chdb (ClickHouse's engine, in-process) with its Delta reader, `deltaLakeLocal`, and
    `quantileExactInclusive`: linear interpolation between the closest ranks, DuckDB's
    `quantile_cont` (R-7), so its p50/p95 are servescope's to the last digit. chdb reads only
    under its `user_files_path`, the working directory."""
    import chdb  # the dev extra's

    monkeypatch.chdir("/")
    sql = f"""
    SELECT run_id, count() AS requests, countIf(status != 'ok') AS errors,
           quantileExactInclusiveIf(0.5)(ttft_ms, status = 'ok') AS p50,
           quantileExactInclusiveIf(0.95)(ttft_ms, status = 'ok') AS p95
    FROM deltaLakeLocal('{fleet["lake"] / "events"}')
    GROUP BY run_id ORDER BY run_id FORMAT JSONEachRow
    """  # noqa: S608 - a path this test made
    rows = [json.loads(line) for line in str(chdb.query(sql)).splitlines() if line.strip()]
    got = {r.pop("run_id"): r for r in rows}
    assert got == _expected(fleet)


def test_polars_reads_the_same_numbers(fleet: dict[str, Any]) -> None:
    """Polars' `scan_delta`; its "linear" quantile is R-7 too."""
    import polars as pl  # the dev extra's

    ok = pl.col("status") == "ok"
    frame = (
        pl.scan_delta(str(fleet["lake"] / "events"))
        .group_by("run_id")
        .agg(
            pl.len().alias("requests"),
            (~ok).sum().alias("errors"),
            pl.col("ttft_ms").filter(ok).quantile(0.5, "linear").alias("p50"),
            pl.col("ttft_ms").filter(ok).quantile(0.95, "linear").alias("p95"),
        )
        .collect()
    )
    got = {r.pop("run_id"): r for r in frame.to_dicts()}
    assert got == _expected(fleet)


def test_an_object_store_lake_goes_through_delta_rs(tmp_path: Path) -> None:
    """`--lake s3://bucket/prefix` is written by delta-rs' object store, with the credentials
    and endpoint from AWS's usual variables: here an endpoint nothing listens on, so the
    collector says where it could not write, and why, in one line (no S3 here to write to)."""
    events = tmp_path / "run.events.jsonl"
    events.write_text(json.dumps({"request_id": "run-s3-1", "ttft_ms": 1.0}) + "\n")
    env = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}",
           "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}  # fmt: skip
    done = subprocess.run(
        [*SERVESCOPE, "collect", "--once", "--events", str(events), "--store",
         str(tmp_path / "s.duckdb"), "--lake", "s3://bucket/prefix"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    said = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 1, said
    assert "cannot write the lake at s3://bucket/prefix" in said
    assert "Connection refused" in said and "Traceback" not in said
