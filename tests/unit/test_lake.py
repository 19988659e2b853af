"""The shared Parquet lake (`collect --lake`, `--lake` on reading commands; store/lake.py).

Three sidecars (real `servescope collect` processes, each with its own store) tail their own
`.events.jsonl` streams into one lake folder while one of them is SIGKILLed and restarted
mid-stream; afterwards the lake holds every request exactly once, `report build --lake` equals
the report of one store that ingested all three streams, and ClickHouse's engine (chdb,
in-process) reads the same files to the same counts and TTFT quantiles.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import duckdb
import pytest

from servescope.store import Store
from servescope.store.lake import LakeWriter, list_files, part_name
from servescope.store.lakecompact import compact
from servescope.store.lakeread import Lake

RUNS = ("run-20261125-lake-base", "run-20261125-lake-new")
SIDECARS = 3
PER_SIDECAR = 3000  # request records per sidecar
STEPS = 30


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


def _sizes(paths: list[Path]) -> list[int]:
    return [p.stat().st_size for p in paths]


# -- the writer's rules, in-process on real stores and files ------------------------------------


def _flush(
    store: Store, writer: LakeWriter, docs: list[dict[str, Any]], *, crash: bool = False
) -> None:
    """One flush as the collector makes it: the rows and the lake in one store transaction (new
    requests' events written right after the commit: waited for here); `crash` raises between
    the lake's files and the commit (a fault injected here because a real crash cannot be
    timed to that instant)."""

    class Crash(Exception):
        pass

    try:
        with store.write() as con:
            mark = writer.mark(con)
            store.add_events(docs, con)
            written = writer.write(con, mark)
            if crash:
                raise Crash
        writer.committed(written)
        writer.wait()
    except Crash:
        writer.failed(written)


def _doc(run: str, i: int, **more: Any) -> dict[str, Any]:
    return {"request_id": f"{run}-{i:04d}", "run_id": run, "ts": "2026-11-25T10:00:00Z",
            "ttft_ms": float(i), "status": "ok", **more}  # fmt: skip


def test_a_flush_the_store_never_committed_leaves_no_row(tmp_path: Path) -> None:
    store, lake = Store(tmp_path / "s.duckdb"), tmp_path / "lake"
    writer = LakeWriter(lake, store)
    _flush(store, writer, [_doc("run-a", i) for i in range(10)])
    update = [{"request_id": "run-a-0001", "run_id": "run-a", "cached_tokens": 3}]
    _flush(store, writer, update + [_doc("run-a", i) for i in range(10, 20)], crash=True)
    assert len(list_files(lake, "events")) == 2  # flush 2's file is there, uncommitted
    restarted = LakeWriter(lake, store)  # a new process: same sidecar, same committed flush
    assert restarted.sidecar == writer.sidecar and restarted.seq == 1
    assert len(list_files(lake, "events")) == 1
    _flush(store, restarted, update + [_doc("run-a", i) for i in range(10, 25)])  # read again
    with Lake([lake]).read() as con:
        assert con.execute(
            "SELECT count(*), count(DISTINCT request_id), max(cached_tokens) FROM events"
        ).fetchone() == (25, 25, 3)


def test_a_crash_in_a_stores_first_flush_leaves_no_file_behind(tmp_path: Path) -> None:
    """The sidecar's name is in the store before any file carries it: a crash in a new store's
    first flush, between the lake's files and the commit, leaves files that the restart knows as
    its own and removes. (A restart under a new name would leave them in the lake for good: the
    flush's tool call twice, once the flush is read again.)"""
    store, lake = Store(tmp_path / "s.duckdb"), tmp_path / "lake"
    tool = {"type": "tool_call", "run_id": "run-a", "ts": "2026-11-25T10:00:00Z", "tool": "t1"}
    writer = LakeWriter(lake, store)
    _flush(store, writer, [tool, _doc("run-a", 1)], crash=True)
    assert len(list_files(lake, "runtime_events")) == 1  # flush 1's file is there, uncommitted
    restarted = LakeWriter(lake, store)  # a new process
    assert restarted.sidecar == writer.sidecar and restarted.seq == 0
    assert list_files(lake, "runtime_events") == []
    _flush(store, restarted, [tool, _doc("run-a", 1)])  # read again
    with Lake([lake]).read() as con:
        assert con.execute("SELECT count(*) FROM runtime_events").fetchone() == (1,)
        assert con.execute("SELECT count(*) FROM events").fetchone() == (1,)


@pytest.mark.parametrize("cut_short", [False, True])
def test_a_crash_before_a_flushs_events_are_written_loses_and_doubles_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut_short: bool
) -> None:
    """New requests' events are written after their flush's commit: a crash before that (the
    thread never ran; or it left a file cut short) is made good by the next start, once."""
    store, lake = Store(tmp_path / "s.duckdb"), tmp_path / "lake"
    writer = LakeWriter(lake, store)
    _flush(store, writer, [_doc("run-a", i) for i in range(10)])
    monkeypatch.setattr(LakeWriter, "_write_after_commit", lambda self, deferred: None)
    with store.write() as con:  # flush 2 commits; the process dies before its events are out
        mark = writer.mark(con)
        store.add_events([_doc("run-a", i) for i in range(10, 30)], con)
        written = writer.write(con, mark)
    assert written is not None and written.deferred is not None
    assert len(list_files(lake, "events")) == 1
    if cut_short:
        (lake / "events" / "run_id=run-a" / "date=2026-11-25" / part_name(writer.sidecar, 2)
         ).write_bytes(b"PAR1 cut short")  # fmt: skip
    monkeypatch.undo()
    restarted = LakeWriter(lake, store)  # a new process: writes flush 2's events first
    assert restarted.seq == 2 and restarted.published == 2
    _flush(store, restarted, [_doc("run-a", i) for i in range(30, 35)])
    with Lake([lake]).read() as con:
        assert con.execute(
            "SELECT count(*), count(DISTINCT request_id) FROM events"
        ).fetchone() == (35, 35)
    assert len(list_files(lake, "events")) == 3


def test_versions_and_moves_resolve_to_the_store_row(tmp_path: Path) -> None:
    store, lake = Store(tmp_path / "s.duckdb"), tmp_path / "lake"
    writer = LakeWriter(lake, store)
    _flush(store, writer, [_doc("vllm-unattributed", i) for i in range(5)] + [_doc("run-b", 1)])
    _flush(store, writer, [{"request_id": "run-b-0001", "run_id": "run-b", "cached_tokens": 9}])
    with store.write() as con:  # the collector moving requests to their session's run
        mark = writer.mark(con)
        moved = store.take_events("vllm-unattributed", ["vllm-unattributed-0001"], con)
        for doc in moved:
            doc["run_id"] = "vllm-tiny-8000-20261125T100000Z"
        store.add_events(moved, con)
        written = writer.write(con, mark)
    writer.committed(written)
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


def test_compaction_merges_parts_and_readers_never_see_a_row_twice(tmp_path: Path) -> None:
    store, lake = Store(tmp_path / "s.duckdb"), tmp_path / "lake"
    writer = LakeWriter(lake, store)
    for k in range(12):  # a trickle: one small file per flush
        _flush(store, writer, [_doc("run-c", k * 10 + i) for i in range(10)])
    _flush(store, writer, [{"request_id": "run-c-0003", "run_id": "run-c", "cached_tokens": 1}])

    def seen() -> tuple[int, int, int]:
        with Lake([lake]).read() as con:
            row = con.execute(
                "SELECT count(*), count(DISTINCT request_id), max(cached_tokens) FROM events"
            ).fetchone()
        return tuple(row)  # type: ignore[return-value]

    assert seen() == (120, 120, 1)
    parts = sorted((lake / "events").rglob("part-*.parquet"))
    report = compact(lake, writer.sidecar, writer.seq, min_files=4, grace_s=3600)
    assert report.merged == 1 and report.parts == 13
    assert all(p.exists() for p in parts)  # kept through the grace: a reader may have listed them
    assert seen() == (120, 120, 1)  # the merged file alone, never it and its parts
    compact(lake, writer.sidecar, writer.seq, grace_s=0)
    assert not any(p.exists() for p in parts)
    assert seen() == (120, 120, 1)


def test_run_ids_that_are_no_folder_names(tmp_path: Path) -> None:
    store, lake = Store(tmp_path / "s.duckdb"), tmp_path / "lake"
    writer = LakeWriter(lake, store)
    odd = ["a/b", "../x", "run 1%", "é" * 150, "x" * 300, "__HIVE_DEFAULT_PARTITION__", "123"]
    _flush(store, writer, [_doc(run, 1) for run in odd])
    assert all(".." not in p.relative_to(lake).parts for p in lake.rglob("*"))
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


def test_a_server_sessions_report_from_the_lake_equals_the_stores(tmp_path: Path) -> None:
    """A session's run holds its own requests and those it served for client runs (in other
    runs' folders): a lake scoped to it reads the folders of its lifetime's days."""
    from servescope.reports import ReportOptions, build_summary

    store, lake = Store(tmp_path / "s.duckdb"), tmp_path / "lake"
    writer = LakeWriter(lake, store)
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
        written = writer.write(con, mark, runs=[session])
    writer.committed(written)
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
    writer = LakeWriter(lake, store)
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
