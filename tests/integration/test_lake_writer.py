"""The lake's writer and reader in-process, on real stores and real Delta tables
(store/lake.py, store/lakeread.py, store/lakecompact.py): a flush reaches the lake once whatever
instant a crash picks, updates and moves resolve to the store's row, compaction and expiry keep
every reader's view whole. tests/integration/test_lake.py runs three real sidecars.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb
import pytest
from deltalake import DeltaTable

from servescope.store import Store
from servescope.store import lake as lake_module
from servescope.store.lake import LakeWriter, Owed
from servescope.store.lakecompact import compact, expire
from servescope.store.lakeread import Lake


def _stored(store: Path) -> int:
    try:
        con = duckdb.connect(str(store), read_only=True)
    except duckdb.Error:
        return -1
    try:
        row = con.execute("SELECT count(*) FROM checkpoints").fetchone()
        return int(row[0]) if row else 0
    except duckdb.Error:
        return -1
    finally:
        con.close()


def _writer(lake: Path, store: Store) -> LakeWriter:
    """A writer that writes each flush at once (a collector's waits `INTERVAL_S` between)."""
    return LakeWriter(lake, store, interval_s=0)


class Crash(Exception):
    """A fault injected at an instant a real crash cannot be timed to."""


def _flush(
    store: Store, writer: LakeWriter, docs: list[dict[str, Any]], *, crash: bool = False
) -> Owed | None:
    """One flush as the collector makes it: the rows and what the lake is owed in one store
    transaction, then the lake's commits (waited for here); `crash` raises before the store
    commits."""
    owed = None
    try:
        with store.write() as con:
            mark = writer.mark(con)
            store.add_events(docs, con)
            owed = writer.owe(con, mark)
            if crash:
                raise Crash
        writer.committed(owed)
        writer.wait()
    except Crash:
        return None
    return owed


def _doc(run: str, i: int, **more: Any) -> dict[str, Any]:
    return {"request_id": f"{run}-{i:04d}", "run_id": run, "ts": "2026-11-25T10:00:00Z",
            "ttft_ms": float(i), "status": "ok", **more}  # fmt: skip


def _seen(lake: Path) -> tuple[int, int, int]:
    with Lake([lake]).read() as con:
        row = con.execute(
            "SELECT count(*), count(DISTINCT request_id), max(cached_tokens) FROM events"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2] or 0)


def test_a_flush_the_store_never_committed_leaves_no_row(tmp_path: Path) -> None:
    store, lake = Store(tmp_path / "s.duckdb"), tmp_path / "lake"
    writer = _writer(lake, store)
    _flush(store, writer, [_doc("run-a", i) for i in range(10)])
    update = [{"request_id": "run-a-0001", "run_id": "run-a", "cached_tokens": 3}]
    _flush(store, writer, update + [_doc("run-a", i) for i in range(10, 20)], crash=True)
    assert _seen(lake) == (10, 10, 0)
    restarted = _writer(lake, store)  # a new process: same sidecar, same committed flush
    assert restarted.sidecar == writer.sidecar and restarted.seq == 1
    _flush(store, restarted, update + [_doc("run-a", i) for i in range(10, 25)])  # read again
    assert _seen(lake) == (25, 25, 3)


@pytest.mark.parametrize(
    ("dies", "fresh"),
    [("before any table", False), ("before any table", True), ("between two tables", False)],
)
def test_a_crash_after_the_stores_commit_loses_and_doubles_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dies: str, fresh: bool
) -> None:
    """The store committed flush 2; the process died before the lake had all of it (no table,
    or `events` but not `runtime_events`): the next start writes what each table lacks, once.
    `fresh`: flush 2 is a backlog's (every request new), read after its commit."""
    monkeypatch.setattr(lake_module, "FRESH_ROWS", 15 if fresh else 10**9)
    originals = (LakeWriter._write_after_commit, LakeWriter._write_runtime_events)
    store, lake = Store(tmp_path / "s.duckdb"), tmp_path / "lake"
    tool = {"type": "tool_call", "run_id": "run-a", "ts": "2026-11-25T10:00:00Z", "tool": "t1"}
    writer = _writer(lake, store)
    _flush(store, writer, [_doc("run-a", i) for i in range(10)])
    if dies == "before any table":
        monkeypatch.setattr(LakeWriter, "_write_after_commit", lambda _self, _pending: None)
    else:

        def crash(*_args: Any) -> None:
            raise Crash

        monkeypatch.setattr(LakeWriter, "_write_runtime_events", crash)
    with store.write() as con:
        mark = writer.mark(con)
        store.add_events([tool, *(_doc("run-a", i) for i in range(10, 30))], con)
        owed = writer.owe(con, mark)
    assert owed is not None and bool(owed.fresh) == fresh and (owed.held is None) == fresh
    writer.committed(owed)
    if dies != "before any table":
        writer.wait()
        assert _seen(lake) == (30, 30, 0)
    monkeypatch.setattr(LakeWriter, "_write_after_commit", originals[0])
    monkeypatch.setattr(LakeWriter, "_write_runtime_events", originals[1])
    restarted = _writer(lake, store)  # a new process: writes flush 2's missing part first
    assert restarted.seq == 2
    with Lake([lake]).read() as con:
        assert con.execute("SELECT count(*) FROM runtime_events").fetchone() == (1,)
    assert _seen(lake) == (30, 30, 0)
    _writer(lake, store)  # and a start after that writes nothing again
    _flush(store, restarted, [_doc("run-a", i) for i in range(30, 35)])
    assert _seen(lake) == (35, 35, 0)
    events = DeltaTable(str(lake / "events"))
    assert events.transaction_version(restarted.app_id) == 3


def test_a_failed_lake_write_is_made_good_by_the_next_flush(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The thread could not write flush 1 (a full disk); flush 2's transaction writes it first,
    from the store as flush 1 left it, and then itself."""
    store, lake = Store(tmp_path / "s.duckdb"), tmp_path / "lake"
    writer = _writer(lake, store)
    original = LakeWriter._write_events
    calls = {"n": 0}

    def flaky(self: LakeWriter, *args: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(28, "No space left on device")
        original(self, *args)

    monkeypatch.setattr(LakeWriter, "_write_events", flaky)
    _flush(store, writer, [_doc("run-a", i) for i in range(10)])
    assert _seen(lake) == (0, 0, 0)
    _flush(store, writer, [{"request_id": "run-a-0002", "run_id": "run-a", "cached_tokens": 4}])
    assert _seen(lake) == (10, 10, 4)


def _rows_of(source: Store | Lake) -> list[tuple[Any, ...]]:
    with source.read() as con:
        return con.execute("SELECT run_id, request_id, doc FROM events ORDER BY 1, 2").fetchall()


@pytest.mark.parametrize("then", ["drained", "killed"])
def test_a_trickles_flushes_reach_the_lake_together(tmp_path: Path, then: str) -> None:
    """Flushes not yet written (within the writer's interval) go to the lake as one write: a
    request new in one and completed in the next is one row, one moved away is only deleted.
    A process killed before that write leaves them to the next start, which writes them once."""
    store, lake = Store(tmp_path / "s.duckdb"), tmp_path / "lake"
    writer = LakeWriter(lake, store, interval_s=3600)
    _flush(store, writer, [_doc("run-a", i) for i in range(5)])  # the first: written at once
    assert _seen(lake) == (5, 5, 0)
    _flush(store, writer, [_doc("vllm-unattributed", i) for i in range(3)] + [_doc("run-a", 5)])
    _flush(
        store,
        writer,
        [
            {"request_id": "run-a-0005", "run_id": "run-a", "cached_tokens": 7},
            {"request_id": "run-a-0001", "run_id": "run-a", "cached_tokens": 2},
        ],
    )
    with store.write() as con:  # a move of a request the lake has not seen yet
        mark = writer.mark(con)
        moved = store.take_events("vllm-unattributed", ["vllm-unattributed-0001"], con)
        for doc in moved:
            doc["run_id"] = "vllm-tiny-node-8000-20261125T100000Z"
        store.add_events(moved, con)
        owed = writer.owe(con, mark)
    writer.committed(owed)
    assert _seen(lake) == (5, 5, 0)  # within the interval: nothing written yet
    if then == "drained":
        writer.drain()
    else:
        writer = LakeWriter(lake, store, interval_s=3600)  # a new process, the old one killed
    assert _rows_of(Lake([lake])) == _rows_of(store)
    assert _seen(lake) == (9, 9, 7)
    events = DeltaTable(str(lake / "events"))
    assert events.transaction_version(writer.app_id) == 4
    assert len(events.history()) <= 3  # created, the first flush, the other three together


def test_versions_and_moves_resolve_to_the_store_row(tmp_path: Path) -> None:
    store, lake = Store(tmp_path / "s.duckdb"), tmp_path / "lake"
    writer = _writer(lake, store)
    _flush(store, writer, [_doc("vllm-unattributed", i) for i in range(5)] + [_doc("run-b", 1)])
    owed = _flush(store, writer, [{"request_id": "run-b-0001", "run_id": "run-b",
                                   "cached_tokens": 9}])  # fmt: skip
    assert owed is not None and owed.updated == [("run-b", "run-b-0001")] and not owed.moved
    with store.write() as con:  # the collector moving requests to their session's run
        mark = writer.mark(con)
        moved = store.take_events("vllm-unattributed", ["vllm-unattributed-0001"], con)
        for doc in moved:
            doc["run_id"] = "vllm-tiny-8000-20261125T100000Z"
        store.add_events(moved, con)
        owed = writer.owe(con, mark)
    assert owed is not None and owed.moved == [("vllm-unattributed", "vllm-unattributed-0001")]
    writer.committed(owed)
    writer.wait()
    with Store(store.path).read() as con:
        expected = con.execute(
            "SELECT run_id, request_id, doc FROM events ORDER BY 1, 2"
        ).fetchall()
    with Lake([lake]).read() as con:
        got = con.execute("SELECT run_id, request_id, doc FROM events ORDER BY 1, 2").fetchall()
    assert got == expected
    assert (
        json.loads(dict(((r, q), d) for r, q, d in got)[("run-b", "run-b-0001")])["cached_tokens"]
        == 9
    )
    raw = duckdb.connect()  # what any Delta reader sees: the same rows, no rule applied
    raw.register("events", DeltaTable(str(lake / "events")).to_pyarrow_dataset())
    assert raw.execute("SELECT count(*) FROM events").fetchone() == (len(expected),)


def test_compaction_and_vacuum_keep_each_row_once(tmp_path: Path) -> None:
    store, lake = Store(tmp_path / "s.duckdb"), tmp_path / "lake"
    writer = _writer(lake, store)
    for k in range(12):  # a trickle: one small file per flush
        _flush(store, writer, [_doc("run-c", k * 10 + i) for i in range(10)])
    _flush(store, writer, [{"request_id": "run-c-0003", "run_id": "run-c", "cached_tokens": 1}])
    events = DeltaTable(str(lake / "events"))
    before = events.version()
    assert len(events.file_uris()) >= 12
    assert _seen(lake) == (120, 120, 1)
    assert compact(writer)["events"] >= 12
    assert len(DeltaTable(str(lake / "events")).file_uris()) == 1
    assert _seen(lake) == (120, 120, 1)
    old = DeltaTable(str(lake / "events"), version=before)  # a reader of the older version
    assert old.to_pyarrow_table().num_rows == 120
    assert compact(writer) == {}  # nothing written since: nothing to do
    expire(writer, None)
    assert _seen(lake) == (120, 120, 1)


def test_expiry_drops_old_samples_and_keeps_requests(tmp_path: Path) -> None:
    store, lake = Store(tmp_path / "s.duckdb"), tmp_path / "lake"
    writer = _writer(lake, store)
    now = datetime(2026, 11, 27, 12)
    with store.write() as con:
        mark = writer.mark(con)
        store.add_events([_doc("run-a", i) for i in range(5)], con)
        store.add_metric_samples(
            [(now - timedelta(days=d), "t", "vllm:num_requests_running", {}, None, float(d))
             for d in (0, 1, 13, 15, 30)],
            con,
        )  # fmt: skip
        owed = writer.owe(con, mark)
    writer.committed(owed)
    writer.wait()
    assert expire(writer, timedelta(days=14), now=now) == 2
    with Lake([lake]).read() as con:
        values = sorted(v for (v,) in con.execute("SELECT value FROM metric_samples").fetchall())
    assert values == [0.0, 1.0, 13.0]
    assert _seen(lake) == (5, 5, 0)


def test_run_ids_that_are_no_folder_names(tmp_path: Path) -> None:
    store, lake = Store(tmp_path / "s.duckdb"), tmp_path / "lake"
    writer = _writer(lake, store)
    odd = ["a/b", "../x", "run 1%", "é" * 150, "x" * 300, "__HIVE_DEFAULT_PARTITION__", "123",
           "~", "it's"]  # fmt: skip
    _flush(store, writer, [_doc(run, 1) for run in odd])
    assert all(".." not in p.relative_to(lake).parts for p in lake.rglob("*"))
    assert all(len(p.name.encode()) < 255 for p in lake.rglob("*"))
    with Lake([lake]).read() as con:
        runs = {r for (r,) in con.execute("SELECT DISTINCT run_id FROM events").fetchall()}
    assert runs == set(odd)
    for run in odd:
        lake_reader = Lake([lake]).scoped([run])
        assert lake_reader.has_run(run)
        with lake_reader.read() as con:
            assert con.execute(
                "SELECT count(*) FROM events WHERE run_id = $1", [run]
            ).fetchone() == (1,)
    assert not Lake([lake]).has_run("run-nope")


def test_a_server_sessions_report_from_the_lake_equals_the_stores(tmp_path: Path) -> None:
    """A session's run holds its own requests and those it served for client runs (in other
    runs' partitions): a lake scoped to it reads them by `vllm_session`."""
    from servescope.reports import ReportOptions, build_summary

    store, lake = Store(tmp_path / "s.duckdb"), tmp_path / "lake"
    writer = _writer(lake, store)
    session = "vllm-tiny-8000-20261125T100000Z"
    served = [
        _doc("run-client", i, vllm_session=session, server_ttft_ms=float(i) / 3, source="client")
        for i in range(40)
    ]
    own = [
        {**_doc(session, i, vllm_session=session, source="vllm-log"), "request_id": f"{i:032x}"}
        for i in range(30)
    ]
    elsewhere = [_doc("run-other", i, ts="2026-11-01T10:00:00Z") for i in range(20)]
    with store.write() as con:
        mark = writer.mark(con)
        store.add_events(served + own + elsewhere, con)
        store.upsert_run(session, con, started_at=datetime(2026, 11, 25, 10), label="session")
        owed = writer.owe(con, mark, runs=[session])
    writer.committed(owed)
    writer.wait()
    options = ReportOptions(charts=False)
    from_store = build_summary(store, session, options)
    from_lake = build_summary(Lake([lake]).scoped([session]), session, options)
    assert from_store["overall"]["requests"] == 70
    assert from_lake == from_store


def test_a_fleet_runs_report_from_the_lake_equals_the_stores(tmp_path: Path) -> None:
    """A fleet run's replicas are read from each request's verbatim record (`upstream`,
    `routing`): a lake report keeps it where the runs are fleet runs."""
    from servescope.reports import ReportOptions, build_diff

    store, lake = Store(tmp_path / "s.duckdb"), tmp_path / "lake"
    writer = _writer(lake, store)
    docs = [
        _doc(run, i, upstream=f"r{i % 2}", routing="least-loaded", route_reason="least-loaded",
             ttft_ms=float(i % 7) + (i % 2) * 10, tpot_ms=3.0, itl_ms=[1.0, 2.0 + i % 3])
        for run in ("run-fleet-a", "run-fleet-b")
        for i in range(60)
    ]  # fmt: skip
    _flush(store, writer, docs)
    options = ReportOptions(charts=False)
    from_store = build_diff(store, "run-fleet-b", "run-fleet-a", options)
    lake_store = Lake([lake]).scoped(["run-fleet-b", "run-fleet-a"])
    from_lake = build_diff(lake_store, "run-fleet-b", "run-fleet-a", options)
    assert [r["replica"] for r in from_store["replicas"]] == ["r0", "r1"]
    assert from_lake == from_store
