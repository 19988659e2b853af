"""Delta Lake, Apache Iceberg and DuckLake as the shared lake's table format, measured.

Run it under the side virtualenv, never the project's .venv: the project's DuckDB (2.0.x) has
no delta/iceberg/ducklake extension wheels on the index (they stop at 1.5.5), so the side env
pins DuckDB 1.5.5 and its extension wheels next to deltalake, pyiceberg, polars and chdb:

    make lake-formats-env                        # builds .lakeformats/
    .lakeformats/bin/python benchmarks/lake_formats/bench_lake_formats.py [--rows N] [--json]

The same synthetic request events for every format (run_id, request_id, ts, status, ttft_ms,
tpot_ms, e2e_ms, model and a ~200-byte doc), each criterion measured in this run:

    a  writers    3 processes append 20-row batches to one table; writer 0 is SIGKILLed at
                  random moments --kills times and restarted. Every commit carries the format's
                  idempotency marker (Delta: app transaction; Iceberg: snapshot summary
                  property; DuckLake: a progress row in the same transaction), and a restarted
                  writer resumes after the last batch the table says it committed. Counted
                  after: rows lost, rows twice, table readable, files no commit references.
                  DuckLake also: can a second process attach a DuckDB-file catalog?
    b  merge      a trace completing logged requests: upsert 4,000 updates + 1,000 new rows
                  into 100,000 (time, right rows after); then 5 merges while another process
                  appends, to the merged run or another one, unpartitioned and partitioned by
                  run_id: merges that succeed or fail (the error), appends that fail
    c  trickle    --trickle commits of 20 rows, the report query per reader, compaction
                  (Delta: optimize.compact + vacuum; Iceberg: pyiceberg 0.12 has no rewrite, so
                  overwrite with its own rows + expire_snapshots; DuckLake:
                  ducklake_merge_adjacent_files + expire + cleanup), the query again; files
    d  ingest     --rows rows in 50,000-row commits (rows/s), then the report query (count,
                  p50/p95 TTFT of ok requests per run) per reader, checked against DuckDB over
                  the generated rows
    e  readers    each reader of d: works (and agrees) or the error

Prints a table per criterion; --json prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

RUNS = 8
BATCH = 20
MERGE_DEADLINE_S = 45  # b: merges still running then are killed and counted unfinished
SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("request_id", pa.string()),
        ("ts", pa.timestamp("us", tz="UTC")),
        ("status", pa.string()),
        ("ttft_ms", pa.float64()),
        ("tpot_ms", pa.float64()),
        ("e2e_ms", pa.float64()),
        ("model", pa.string()),
        ("doc", pa.string()),
    ]
)
KEY = "t.run_id = s.run_id AND t.request_id = s.request_id"
REPORT_SQL = (
    "SELECT run_id, count(*) AS n, "
    "quantile_cont(ttft_ms, 0.5) FILTER (WHERE status = 'ok') AS p50, "
    "quantile_cont(ttft_ms, 0.95) FILTER (WHERE status = 'ok') AS p95 "
    "FROM {src} GROUP BY run_id ORDER BY run_id"
)
CH_REPORT_SQL = (
    "SELECT run_id, count() AS n, "
    "quantileExactInclusiveIf(0.5)(ttft_ms, status = 'ok') AS p50, "
    "quantileExactInclusiveIf(0.95)(ttft_ms, status = 'ok') AS p95 "
    "FROM {src} GROUP BY run_id ORDER BY run_id FORMAT JSONCompact"
)
T0 = datetime(2026, 11, 27, tzinfo=UTC)
Report = list[tuple[str, int, float | None, float | None]]


# ---------------------------------------------------------------- data
def batch(prefix: str, n: int, seed: int, run: str | None = None, tpot: bool = True) -> pa.Table:
    """n request events; request ids `prefix-i`, runs spread over RUNS unless `run` is given."""
    rng = random.Random(seed)
    ids = [f"{prefix}-{i}" for i in range(n)]
    runs = [run or f"run-{i % RUNS}" for i in range(n)]
    ok = [rng.random() > 0.01 for _ in range(n)]
    ttft = [rng.lognormvariate(4.0, 0.6) for _ in range(n)]
    doc_pad = "x" * 150
    return pa.table(
        {
            "run_id": runs,
            "request_id": ids,
            "ts": [T0 + timedelta(microseconds=seed * 1000 + i) for i in range(n)],
            "status": ["ok" if o else "http_5xx" for o in ok],
            "ttft_ms": ttft,
            "tpot_ms": [rng.uniform(5, 40) if tpot else None for _ in range(n)],
            "e2e_ms": [t + rng.uniform(100, 4000) for t in ttft],
            "model": ["tiny"] * n,
            "doc": [f'{{"id":"{i}","seed":{seed},"pad":"{doc_pad}"}}' for i in ids],
        },
        schema=SCHEMA,
    )


def files_under(path: Path, suffix: str = ".parquet") -> int:
    return sum(1 for p in path.rglob(f"*{suffix}") if p.is_file())


def load_ext(con: duckdb.DuckDBPyConnection, *names: str) -> None:
    """LOAD the extension shipped inside a `duckdb-extension-<name>` wheel (no network)."""
    for name in names:
        mod = importlib.import_module(f"duckdb_extension_{name}")
        (ext,) = Path(str(mod.__file__)).parent.glob("extensions/*/*.duckdb_extension")
        con.execute(f"LOAD '{ext}'")


def short(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"


def duck_report(con: duckdb.DuckDBPyConnection, src: str, **tables: Any) -> Report:
    """REPORT_SQL over `src`; `tables` are Arrow objects registered under their names first."""
    for name, t in tables.items():
        con.register(name, t)
    rows = con.execute(REPORT_SQL.format(src=src)).fetchall()
    return [(r[0], int(r[1]), r[2], r[3]) for r in rows]


# ---------------------------------------------------------------- formats
class Fmt:
    """One table of one format under `root`; the same operations for all three."""

    name = ""

    def __init__(self, root: Path, partitioned: bool = False) -> None:
        self.root = root
        self.partitioned = partitioned

    def create(self) -> None:
        raise NotImplementedError

    def append(self, t: pa.Table) -> None:
        raise NotImplementedError

    def append_once(self, t: pa.Table, writer: str, k: int) -> None:
        raise NotImplementedError

    def last_batch(self, writer: str) -> int:
        raise NotImplementedError

    def merge(self, t: pa.Table, run: str | None = None) -> None:
        raise NotImplementedError

    def keys(self) -> pa.Table:
        raise NotImplementedError

    def compact(self) -> None:
        raise NotImplementedError

    def live_files(self) -> int:
        raise NotImplementedError

    def disk_files(self) -> int:
        raise NotImplementedError

    def readers(self) -> dict[str, Callable[[], Report]]:
        raise NotImplementedError


class Delta(Fmt):
    name = "delta"

    @property
    def path(self) -> str:
        return str(self.root / "events")

    def create(self) -> None:
        from deltalake import write_deltalake

        write_deltalake(
            self.path, SCHEMA.empty_table(), partition_by=["run_id"] if self.partitioned else None
        )

    def append(self, t: pa.Table) -> None:
        from deltalake import write_deltalake

        write_deltalake(self.path, t, mode="append")

    def append_once(self, t: pa.Table, writer: str, k: int) -> None:
        from deltalake import CommitProperties, Transaction, write_deltalake

        props = CommitProperties(app_transactions=[Transaction(writer, k)])
        write_deltalake(self.path, t, mode="append", commit_properties=props)

    def last_batch(self, writer: str) -> int:
        from deltalake import DeltaTable

        v = DeltaTable(self.path).transaction_version(writer)
        return -1 if v is None else v

    def merge(self, t: pa.Table, run: str | None = None) -> None:
        from deltalake import DeltaTable

        pred = KEY if run is None else f"t.run_id = '{run}' AND {KEY}"
        (
            DeltaTable(self.path)
            .merge(t, pred, source_alias="s", target_alias="t")
            .when_matched_update_all()
            .when_not_matched_insert_all()
            .execute()
        )

    def keys(self) -> pa.Table:
        from deltalake import DeltaTable

        ds = DeltaTable(self.path).to_pyarrow_dataset()
        return ds.to_table(columns=["run_id", "request_id", "tpot_ms"])

    def compact(self) -> None:
        from deltalake import DeltaTable

        dt = DeltaTable(self.path)
        dt.optimize.compact()
        dt.vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)
        dt.create_checkpoint()
        dt.cleanup_metadata()

    def live_files(self) -> int:
        from deltalake import DeltaTable

        return len(DeltaTable(self.path).file_uris())

    def disk_files(self) -> int:
        return files_under(self.root / "events")

    def readers(self) -> dict[str, Callable[[], Report]]:
        con = duckdb.connect()
        load_ext(con, "delta")

        def duckdb_native() -> Report:
            return duck_report(con, f"delta_scan('{self.path}')")

        def pyarrow_dataset() -> Report:
            from deltalake import DeltaTable

            ds = DeltaTable(self.path).to_pyarrow_dataset()
            return duck_report(duckdb.connect(), "ds", ds=ds)

        def chdb_() -> Report:
            return chdb_report(f"deltaLakeLocal('{self.path}')")

        def polars_() -> Report:
            import polars as pl

            return polars_report(pl.scan_delta(self.path))

        return {
            "duckdb delta_scan": duckdb_native,
            "pyarrow dataset (+duckdb)": pyarrow_dataset,
            "chdb deltaLakeLocal": chdb_,
            "polars scan_delta": polars_,
        }


class Iceberg(Fmt):
    name = "iceberg"

    def catalog(self) -> Any:
        from pyiceberg.catalog.sql import SqlCatalog

        (self.root / "wh").mkdir(parents=True, exist_ok=True)
        return SqlCatalog(
            "bench",
            uri=f"sqlite:///{self.root}/catalog.db",
            warehouse=f"file://{self.root}/wh",
        )

    def table(self) -> Any:
        return self.catalog().load_table("lake.events")

    def create(self) -> None:
        cat = self.catalog()
        cat.create_namespace_if_not_exists("lake")
        tbl = cat.create_table("lake.events", schema=SCHEMA)
        if self.partitioned:
            with tbl.update_spec() as spec:
                spec.add_identity("run_id")

    def append(self, t: pa.Table) -> None:
        self.table().append(t)

    def append_once(self, t: pa.Table, writer: str, k: int) -> None:
        self.table().append(t, snapshot_properties={"writer": writer, "batch": str(k)})

    def last_batch(self, writer: str) -> int:
        best = -1
        for snap in self.table().snapshots():
            s = snap.summary
            if s is not None and s["writer"] == writer:
                best = max(best, int(str(s["batch"])))
        return best

    # `run` is the formats' shared signature (a partitioned format rewrites only that run)
    def merge(self, t: pa.Table, run: str | None = None) -> None:  # noqa: ARG002
        self.table().upsert(t, join_cols=["run_id", "request_id"])

    def keys(self) -> pa.Table:
        return self.table().scan(selected_fields=("run_id", "request_id", "tpot_ms")).to_arrow()

    def compact(self) -> None:
        tbl = self.table()
        tbl.overwrite(tbl.scan().to_arrow())
        tbl = self.table()
        tbl.maintenance.expire_snapshots().older_than(datetime.now(UTC)).commit()

    def live_files(self) -> int:
        return len(self.table().inspect.files())

    def disk_files(self) -> int:
        return files_under(self.root / "wh")

    def readers(self) -> dict[str, Callable[[], Report]]:
        con = duckdb.connect()
        load_ext(con, "avro", "iceberg")

        def duckdb_native() -> Report:
            return duck_report(con, f"iceberg_scan('{self.table().metadata_location}')")

        def pyiceberg_arrow() -> Report:
            arr = self.table().scan(selected_fields=("run_id", "status", "ttft_ms")).to_arrow()
            return duck_report(duckdb.connect(), "arr", arr=arr)

        def chdb_() -> Report:
            loc = self.table().location().removeprefix("file://")
            return chdb_report(f"icebergLocal('{loc}')")

        def polars_() -> Report:
            import polars as pl

            return polars_report(pl.scan_iceberg(self.table()))

        return {
            "duckdb iceberg_scan": duckdb_native,
            "pyiceberg to_arrow (+duckdb)": pyiceberg_arrow,
            "chdb icebergLocal": chdb_,
            "polars scan_iceberg": polars_,
        }


class DuckLake(Fmt):
    """DuckLake with its catalog in SQLite (several processes can open it), data in Parquet."""

    name = "ducklake"
    _con: duckdb.DuckDBPyConnection | None = None
    inline = ""  # DuckLake's default: inserts of up to 10 rows go into the catalog, not Parquet

    def con(self) -> duckdb.DuckDBPyConnection:
        if self._con is None:
            self.root.mkdir(parents=True, exist_ok=True)
            con = duckdb.connect()
            load_ext(con, "sqlite_scanner", "ducklake")
            con.execute(
                f"ATTACH 'ducklake:sqlite:{self.root}/meta.sqlite' AS lake "
                f"(DATA_PATH '{self.root}/data/'{self.inline})"
            )
            self._con = con
        return self._con

    def create(self) -> None:
        c = self.con()
        c.execute(
            "CREATE TABLE lake.events (run_id VARCHAR, request_id VARCHAR, "
            "ts TIMESTAMPTZ, status VARCHAR, ttft_ms DOUBLE, tpot_ms DOUBLE, e2e_ms DOUBLE, "
            "model VARCHAR, doc VARCHAR)"
        )
        c.execute("CREATE TABLE lake.progress (writer VARCHAR, batch INTEGER)")
        if self.partitioned:
            c.execute("ALTER TABLE lake.events SET PARTITIONED BY (run_id)")

    def append(self, t: pa.Table) -> None:
        c = self.con()
        c.register("src", t)
        c.execute("INSERT INTO lake.events SELECT * FROM src")
        c.unregister("src")

    def append_once(self, t: pa.Table, writer: str, k: int) -> None:
        c = self.con()
        c.register("src", t)
        c.execute("BEGIN")
        try:
            c.execute("INSERT INTO lake.events SELECT * FROM src")
            c.execute("INSERT INTO lake.progress VALUES (?, ?)", [writer, k])
            c.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(Exception):
                c.execute("ROLLBACK")
            raise
        finally:
            c.unregister("src")

    def last_batch(self, writer: str) -> int:
        row = (
            self.con()
            .execute(
                "SELECT coalesce(max(batch), -1) FROM lake.progress WHERE writer = ?", [writer]
            )
            .fetchone()
        )
        return int(row[0]) if row else -1

    def merge(self, t: pa.Table, run: str | None = None) -> None:
        c = self.con()
        c.register("src", t)
        on = KEY if run is None else f"t.run_id = '{run}' AND {KEY}"
        try:
            c.execute(
                f"MERGE INTO lake.events t USING src s ON ({on}) "
                "WHEN MATCHED THEN UPDATE SET tpot_ms = s.tpot_ms, e2e_ms = s.e2e_ms, "
                "doc = s.doc, status = s.status, ttft_ms = s.ttft_ms "
                "WHEN NOT MATCHED THEN INSERT *"
            )
        finally:
            c.unregister("src")

    def keys(self) -> pa.Table:
        return self.con().execute("SELECT run_id, request_id, tpot_ms FROM lake.events").arrow()

    def compact(self) -> None:
        c = self.con()
        c.execute("CALL ducklake_flush_inlined_data('lake')")
        c.execute("CALL ducklake_merge_adjacent_files('lake')")
        c.execute("CALL ducklake_expire_snapshots('lake', older_than => now())")
        c.execute("CALL ducklake_cleanup_old_files('lake', cleanup_all => true)")

    def live_files(self) -> int:
        row = self.con().execute("SELECT count(*) FROM ducklake_list_files('lake', 'events')")
        r = row.fetchone()
        return int(r[0]) if r else 0

    def disk_files(self) -> int:
        return files_under(self.root / "data")

    def readers(self) -> dict[str, Callable[[], Report]]:
        def duckdb_native() -> Report:
            return duck_report(self.con(), "lake.events")

        def chdb_() -> Report:
            # ClickHouse has no DuckLake reader; try the nearest thing, to record the error
            return chdb_report(f"ducklake('{self.root}/meta.sqlite')")

        def polars_() -> Report:
            import polars as pl

            scan = getattr(pl, "scan_ducklake", None)
            if scan is None:
                raise NotImplementedError("polars 2.1.0 has no scan_ducklake")
            return polars_report(scan(str(self.root)))

        return {"duckdb ducklake": duckdb_native, "chdb": chdb_, "polars": polars_}


class DuckLakeInline(DuckLake):
    """DuckLake with inserts of up to 100 rows kept in the catalog (data inlining)."""

    name = "ducklake-inline"
    inline = ", DATA_INLINING_ROW_LIMIT 100"


FORMATS: dict[str, type[Fmt]] = {
    "delta": Delta,
    "iceberg": Iceberg,
    "ducklake": DuckLake,
    "ducklake-inline": DuckLakeInline,
}


_CHDB: list[Any] = []


def chdb_report(src: str) -> Report:
    """CH_REPORT_SQL in chdb. Its deltaLakeLocal/icebergLocal refuse a path outside
    `user_files_path` (Code 481, PATH_ACCESS_DENIED), which chdb 4.4 takes as the current
    folder (`?user_files_path=` in the connection string is not honoured): run it from /."""
    import chdb

    if not _CHDB:
        _CHDB.append(chdb.connect(":memory:"))
    with contextlib.chdir("/"):
        res = _CHDB[0].query(CH_REPORT_SQL.format(src=src))
    data = json.loads(res.bytes())["data"]
    return [(r[0], int(r[1]), r[2], r[3]) for r in data]


def polars_report(lf: Any) -> Report:
    import polars as pl

    ok = pl.col("ttft_ms").filter(pl.col("status") == "ok")
    df = (
        lf.group_by("run_id")
        .agg(
            pl.len().alias("n"),
            ok.quantile(0.5, interpolation="linear").alias("p50"),
            ok.quantile(0.95, interpolation="linear").alias("p95"),
        )
        .sort("run_id")
        .collect()
    )
    return [(r[0], int(r[1]), r[2], r[3]) for r in df.iter_rows()]


def same(a: Report, b: Report) -> bool:
    if [(r[0], r[1]) for r in a] != [(r[0], r[1]) for r in b]:
        return False
    for x, y in zip(a, b, strict=True):
        for u, v in ((x[2], y[2]), (x[3], y[3])):
            if (u is None) != (v is None) or (u is not None and abs(u - float(v or 0)) > 1e-6):
                return False
    return True


def append_all(f: Fmt, parts: list[pa.Table]) -> None:
    for p in parts:
        f.append(p)


def key_counts(t: pa.Table) -> tuple[int, int, int]:
    """Rows, distinct (run_id, request_id), rows with tpot_ms, of a keys() table."""
    con = duckdb.connect()
    con.register("k", t)
    row = con.execute(
        "SELECT count(*), count(DISTINCT (run_id, request_id)), count(tpot_ms) FROM k"
    ).fetchone()
    return (int(row[0]), int(row[1]), int(row[2])) if row else (0, 0, 0)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def run_readers(f: Fmt, truth: Report) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, fn in f.readers().items():
        try:
            fn()  # warm: extension load, first-open costs
            dt, rep = timed(fn)
            out[name] = {"ok": True, "s": round(dt, 3), "agrees": same(rep, truth)}
        except Exception as e:  # noqa: BLE001 (recording why a reader fails is the point)
            out[name] = {"ok": False, "error": short(e)}
    return out


# ---------------------------------------------------------------- a: writers, SIGKILL
def worker(fmt: str, root: str, writer: str, batches: int, mode: str) -> None:
    """A child process: append batches (resuming after the table's last one), or a stream."""
    if mode == "hold-file-catalog":  # a: hold a DuckLake with a DuckDB-file catalog open
        c = duckdb.connect()
        load_ext(c, "ducklake")
        file_catalog(c, Path(root))
        c.execute("CREATE TABLE IF NOT EXISTS lake.t (x INT)")
        c.execute("INSERT INTO lake.t VALUES (1)")
        print("ready", flush=True)
        time.sleep(60)
        return
    f = FORMATS[fmt](Path(root))
    retries = 0
    if mode == "stream":  # b: append to a run until told to stop
        k, stop = 0, Path(root) / "stop"
        while not stop.exists():
            try:
                f.append(batch(f"{writer}-{k}", BATCH, 10_000 + k, run=writer))
                k += 1
                time.sleep(0.25)  # a sidecar's flush interval
            except Exception as e:  # noqa: BLE001
                retries += 1
                print(json.dumps({"error": short(e)}), flush=True)
        print(json.dumps({"commits": k, "failed": retries}), flush=True)
        return
    if mode == "merge":  # b: 5 merges into run-0, one JSON line each
        for i in range(batches):
            src = pa.concat_tables(
                [batch("m", 500, 7 + i, run="run-0"), batch(f"mn{i}", 50, i, run="run-0")]
            )
            t = time.perf_counter()
            try:
                f.merge(src, run="run-0" if writer == "part" else None)
                print(json.dumps({"s": round(time.perf_counter() - t, 3)}), flush=True)
            except Exception as e:  # noqa: BLE001
                print(json.dumps({"error": short(e)}), flush=True)
        return
    k = -1  # unknown until the table says (opening it can fail too: a locked catalog)
    while k < batches:
        try:
            if k < 0:
                k = f.last_batch(writer) + 1
                continue
            f.append_once(batch(f"{writer}-b{k}", BATCH, k), writer, k)
            k += 1
        except Exception as e:  # noqa: BLE001
            retries += 1
            print(json.dumps({"error": short(e)}), flush=True)
            time.sleep(0.05)
            if retries > 200:
                raise
    print(json.dumps({"retries": retries}), flush=True)


def spawn(
    fmt: str, root: Path, writer: str, batches: int, mode: str = "once"
) -> subprocess.Popen[str]:
    cmd = [sys.executable, __file__, "--worker", fmt, str(root), writer, str(batches), mode]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def child_lines(p: subprocess.Popen[str]) -> list[dict[str, Any]]:
    out, _ = p.communicate()
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def crit_writers(fmt: str, base: Path, batches: int, kills: int, seed: int) -> dict[str, Any]:
    root = base / f"a-{fmt}"
    f = FORMATS[fmt](root)
    f.create()
    rng = random.Random(seed)
    t0 = time.perf_counter()
    procs = {w: spawn(fmt, root, w, batches) for w in ("w0", "w1", "w2")}
    done_kills, errors, retries = 0, [], 0
    while done_kills < kills and procs["w0"].poll() is None:
        time.sleep(rng.uniform(0.3, 1.5))
        if procs["w0"].poll() is not None:
            break
        procs["w0"].send_signal(signal.SIGKILL)
        procs["w0"].wait()
        done_kills += 1
        procs["w0"] = spawn(fmt, root, "w0", batches)
    rcs, stderr_tail = {}, {}
    for w, p in procs.items():
        out_, err_ = p.communicate()
        lines = [json.loads(x) for x in out_.splitlines() if x.startswith("{")]
        rcs[w] = p.returncode
        if p.returncode:
            stderr_tail[w] = " ".join(err_.split())[-300:]
        errors += [x["error"] for x in lines if "error" in x]
        retries += sum(x.get("retries", 0) for x in lines)
    wall = time.perf_counter() - t0
    res: dict[str, Any] = {"kills": done_kills, "wall_s": round(wall, 1), "exit": rcs}
    if stderr_tail:
        res["stderr"] = stderr_tail
    try:
        total, distinct, _ = key_counts(f.keys())
        expected = 3 * batches * BATCH
        res.update(
            readable=True,
            rows=total,
            lost=expected - distinct,
            duplicated=total - distinct,
            live_files=f.live_files(),
            disk_files=f.disk_files(),
            commits_per_s=round(3 * batches / wall, 1),
        )
        res["unreferenced_files"] = res["disk_files"] - res["live_files"]
    except Exception as e:  # noqa: BLE001
        res.update(readable=False, error=short(e))
    res["writer_errors"] = len(errors)
    res["writer_error_kinds"] = sorted({e.split(":")[0] for e in errors})
    res["writer_error_sample"] = list({e.split(":")[0]: e for e in errors}.values())
    if fmt == "ducklake":
        res["duckdb_file_catalog_second_process"] = ducklake_file_catalog(base)
    return res


def file_catalog(c: duckdb.DuckDBPyConnection, root: Path) -> None:
    c.execute(f"ATTACH 'ducklake:{root}/meta.ducklake' AS lake (DATA_PATH '{root}/data/')")


def ducklake_file_catalog(base: Path) -> str:
    """Can a second process attach a DuckLake whose catalog is a DuckDB file another holds?"""
    root = base / "a-ducklake-file"
    root.mkdir(parents=True, exist_ok=True)
    p = spawn("ducklake", root, "holder", 0, "hold-file-catalog")
    try:
        assert p.stdout is not None
        p.stdout.readline()
        c = duckdb.connect()
        load_ext(c, "ducklake")
        try:
            file_catalog(c, root)
            c.execute("INSERT INTO lake.t VALUES (2)")
            return "attached and wrote"
        except Exception as e:  # noqa: BLE001
            return "refused: " + short(e)
    finally:
        p.kill()
        p.wait()


# ---------------------------------------------------------------- b: merge
def crit_merge(fmt: str, base: Path) -> dict[str, Any]:
    res: dict[str, Any] = {}
    # cost and correctness: 100k logged requests (no tpot), a flush completes 4k and adds 1k
    root = base / f"b-{fmt}"
    f = FORMATS[fmt](root)
    f.create()
    for i in range(2):
        f.append(batch(f"r{i}", 50_000, i, tpot=False))
    upd = batch("r0", 4_000, 0)  # same keys as the first 4,000 of r0, tpot filled
    new = batch("new", 1_000, 99)
    src = pa.concat_tables([upd, new])
    dt, _ = timed(lambda: f.merge(src))
    total, distinct, filled = key_counts(f.keys())
    res["merge_5k_into_100k_s"] = round(dt, 3)
    res["merge_correct"] = total == 101_000 and distinct == 101_000 and filled == 5_000
    res["after_merge"] = {"rows": total, "distinct": distinct, "tpot_filled": filled}
    res["files_after_merge"] = f.live_files()
    # concurrency: merges into run-0 while another process appends
    for part in (False, True):
        for target in ("run-0", "run-3"):
            res[f"concurrent part={part} append_to={target}"] = merge_vs_append(
                fmt, base / f"b-{fmt}-{part}-{target}", part, target
            )
    return res


def merge_vs_append(fmt: str, root: Path, part: bool, target: str) -> dict[str, Any]:
    f = FORMATS[fmt](root, partitioned=part)
    f.create()
    f.append(batch("m", 20_000, 7, run="run-0"))
    f.append(batch("o", 20_000, 8, run="run-3"))
    app = spawn(fmt, root, target, 0, "stream")
    time.sleep(1.0)
    merger = spawn(fmt, root, "part" if part else "nopart", 5, "merge")
    try:
        merger.wait(timeout=MERGE_DEADLINE_S)
        timed_out = False
    except subprocess.TimeoutExpired:
        merger.kill()
        timed_out = True
    lines_m = child_lines(merger)
    ok = sum(1 for x in lines_m if "s" in x)
    errs = [x["error"] for x in lines_m if "error" in x]
    times = [x["s"] for x in lines_m if "s" in x]
    (root / "stop").touch()
    lines = child_lines(app)
    summary = next((x for x in lines if "commits" in x), {})
    app_errs = [x["error"] for x in lines if "error" in x]
    total, distinct, _ = key_counts(f.keys())
    return {
        "merges_ok": ok,
        "merges_failed": len(errs),
        "merge_error": errs[0] if errs else None,
        "merge_s_max": round(max(times), 2) if times else None,
        "merges_unfinished_at_deadline": 5 - ok - len(errs) if timed_out else 0,
        "appends_ok": summary.get("commits"),
        "appends_failed": len(app_errs),
        "append_error": app_errs[0] if app_errs else None,
        "duplicates": total - distinct,
    }


# ---------------------------------------------------------------- c: trickle, compaction
def crit_trickle(fmt: str, base: Path, commits: int) -> dict[str, Any]:
    f = FORMATS[fmt](base / f"c-{fmt}")
    f.create()
    parts = [batch(f"t{i}", BATCH, i) for i in range(commits)]
    truth = duck_report(duckdb.connect(), "all_", all_=pa.concat_tables(parts))
    dt, _ = timed(lambda: append_all(f, parts))
    res: dict[str, Any] = {"commits": commits, "commits_per_s": round(commits / dt, 1)}
    res["before"] = {"live_files": f.live_files(), "disk_files": f.disk_files()}
    res["before"]["read"] = run_readers(f, truth)
    try:
        ct, _ = timed(f.compact)
        res["compact_s"] = round(ct, 2)
        res["after"] = {"live_files": f.live_files(), "disk_files": f.disk_files()}
        res["after"]["read"] = run_readers(f, truth)
    except Exception as e:  # noqa: BLE001
        res["compact_error"] = short(e)
    return res


# ---------------------------------------------------------------- d/e: ingest, readers
@functools.cache
def ingest_parts(rows: int, step: int = 50_000) -> list[pa.Table]:
    return [batch(f"i{i}", min(step, rows - i * step), 1000 + i) for i in range(-(-rows // step))]


def crit_ingest(fmt: str, base: Path, rows: int) -> dict[str, Any]:
    f = FORMATS[fmt](base / f"d-{fmt}")
    f.create()
    parts = ingest_parts(rows)
    truth = duck_report(duckdb.connect(), "all_", all_=pa.concat_tables(parts))
    dt, _ = timed(lambda: append_all(f, parts))
    return {
        "rows": rows,
        "rows_per_s": round(rows / dt),
        "live_files": f.live_files(),
        "read": run_readers(f, truth),
    }


# ---------------------------------------------------------------- output
def table(title: str, head: list[str], rows: list[list[Any]]) -> str:
    cells = [head] + [[str(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(head))]
    lines = [title] + ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)) for r in cells]
    lines.insert(2, "  ".join("-" * x for x in w))
    return "\n".join(lines)


def reader_cell(r: dict[str, Any]) -> str:
    if not r["ok"]:
        return "FAIL " + r["error"][:70]
    return f"{r['s']:.3f}s" + ("" if r["agrees"] else " (DIFFERS)")


def render(out: dict[str, Any]) -> str:
    parts = [f"{out['date']}  {out['machine']}  rows={out['rows']} trickle={out['trickle']}"]
    for criterion, render_one in (
        ("a", render_a),
        ("b", render_b),
        ("c", render_c),
        ("d", render_d),
    ):
        if criterion in out:
            parts.extend(render_one(out))
    return "\n\n".join(parts)


def render_a(out: dict[str, Any]) -> list[str]:
    """Criterion a: three writers, one SIGKILLed and restarted, what each format kept."""
    fm = out["formats"]
    parts: list[str] = []
    rows = []
    for x in fm:
        a = out["a"][x]
        rows.append(
            [
                x,
                a["kills"],
                a.get("readable"),
                a.get("lost"),
                a.get("duplicated"),
                a.get("unreferenced_files"),
                a.get("writer_errors"),
                a.get("commits_per_s"),
                ",".join(a.get("writer_error_kinds", [])),
            ]
        )
    parts.append(
        table(
            "a. 3 writers, writer 0 SIGKILLed and restarted",
            [
                "format",
                "kills",
                "readable",
                "lost",
                "dup",
                "orphans",
                "errors",
                "commit/s",
                "error kinds",
            ],
            rows,
        )
    )
    if "ducklake" in out["a"]:
        parts.append(
            "   DuckLake, DuckDB-file catalog, 2nd process: "
            + out["a"]["ducklake"]["duckdb_file_catalog_second_process"]
        )
    return parts


def render_b(out: dict[str, Any]) -> list[str]:
    """Criterion b: a merge into 100k rows, then merges racing an appending process."""
    fm = out["formats"]
    parts: list[str] = []
    rows = []
    for x in fm:
        b = out["b"][x]
        rows.append(
            [
                x,
                b.get("merge_5k_into_100k_s"),
                b.get("merge_correct"),
                b.get("files_after_merge"),
            ]
        )
    parts.append(
        table("b. merge 4k updates + 1k new into 100k", ["format", "s", "correct", "files"], rows)
    )
    rows = []
    for x in fm:
        for key, v in out["b"][x].items():
            if key.startswith("concurrent"):
                rows.append(
                    [
                        x,
                        key.removeprefix("concurrent "),
                        v["merges_ok"],
                        v["merges_failed"],
                        v["merges_unfinished_at_deadline"],
                        v["merge_s_max"],
                        v["appends_ok"],
                        v["appends_failed"],
                        v["duplicates"],
                        (v["merge_error"] or v["append_error"] or "")[:80],
                    ]
                )
    parts.append(
        table(
            "b. 5 merges into run-0 while another process appends",
            [
                "format",
                "case",
                "merge ok",
                "merge fail",
                "unfinished",
                "max s",
                "appends",
                "app fail",
                "dup",
                "first error",
            ],
            rows,
        )
    )
    return parts


def render_c(out: dict[str, Any]) -> list[str]:
    """Criterion c: a trickle of small commits, before and after compaction."""
    parts: list[str] = []
    rows = []
    for x in out["c"]:
        c = out["c"][x]
        for when in ("before", "after"):
            if when not in c:
                continue
            for rd, r in c[when]["read"].items():
                rows.append(
                    [
                        x,
                        when,
                        c["commits_per_s"],
                        c.get("compact_s", "-"),
                        c[when]["live_files"],
                        c[when]["disk_files"],
                        rd,
                        reader_cell(r),
                    ]
                )
        if "compact_error" in c:
            rows.append([x, "compact", "", "", "", "", "", c["compact_error"][:80]])
    parts.append(
        table(
            f"c. {out['trickle']} commits of {BATCH} rows, compaction",
            [
                "format",
                "when",
                "commit/s",
                "compact s",
                "live",
                "disk",
                "reader",
                "report query",
            ],
            rows,
        )
    )
    return parts


def render_d(out: dict[str, Any]) -> list[str]:
    """Criterion d/e: bulk ingest and the report query."""
    fm = out["formats"]
    parts: list[str] = []
    rows = []
    for x in fm:
        d = out["d"][x]
        for rd, r in d["read"].items():
            rows.append([x, d["rows_per_s"], d["live_files"], rd, reader_cell(r)])
    parts.append(
        table(
            f"d/e. ingest {out['rows']} rows in 50k commits; report query",
            ["format", "rows/s", "files", "reader", "report query"],
            rows,
        )
    )
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0]
        + " Run with .lakeformats/bin/python (make lake-formats-env builds it).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows for d (default 1M)")
    ap.add_argument("--trickle", type=int, default=500, help="commits of 20 rows for c")
    ap.add_argument("--batches", type=int, default=60, help="20-row batches per writer in a")
    ap.add_argument("--kills", type=int, default=5, help="SIGKILLs of writer 0 in a")
    ap.add_argument("--formats", default="delta,iceberg,ducklake", help="comma-separated")
    ap.add_argument("--criteria", default="abcd", help="letters of the criteria to run")
    ap.add_argument("--dir", help="work folder (default: a temporary one, removed)")
    ap.add_argument("--seed", type=int, default=1, help="for a's kill moments")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        fmt, root, writer, batches, mode = args.worker
        worker(fmt, root, writer, int(batches), mode)
        return
    try:
        for name in ("ducklake", "delta", "iceberg", "avro", "sqlite_scanner"):
            importlib.import_module(f"duckdb_extension_{name}")
    except ImportError as e:
        sys.exit(f"{e}: run under .lakeformats/bin/python (make lake-formats-env builds it)")
    formats = args.formats.split(",")
    base = Path(args.dir or tempfile.mkdtemp(prefix="lakeformats-"))
    base.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} CPU cores",
        "rows": args.rows,
        "trickle": args.trickle,
        "formats": formats,
        "versions": versions(),
    }
    try:
        for crit, fn in (
            ("a", lambda x: crit_writers(x, base, args.batches, args.kills, args.seed)),
            ("b", lambda x: crit_merge(x, base)),
            ("c", lambda x: crit_trickle(x, base, args.trickle)),
            ("d", lambda x: crit_ingest(x, base, args.rows)),
        ):
            if crit in args.criteria:
                out[crit] = {}
                extra = ["ducklake-inline"] if crit == "c" and "ducklake" in formats else []
                for x in formats + extra:
                    t = time.perf_counter()
                    try:
                        out[crit][x] = fn(x)
                    except Exception as e:  # noqa: BLE001
                        out[crit][x] = {"error": short(e)}
                    print(f"[{crit} {x} {time.perf_counter() - t:.0f}s]", file=sys.stderr)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(out, indent=1, default=str) if args.json else render(out))


def versions() -> dict[str, str]:
    from importlib.metadata import version

    names = ("duckdb", "duckdb-extension-ducklake", "deltalake", "pyiceberg", "polars", "chdb")
    return {n: version(n) for n in names}


if __name__ == "__main__":
    main()
