"""Agent-runtime lines in `.events.jsonl` files: stored (not quarantined), joinable to requests,
exported back unchanged and in place; and the hive-partitioned Parquet export."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb

from servescope.store import Store, export_run, import_file
from servescope.store.validation import parse_line
from tests.helpers.runtime_lines import LINES, RUN, write_lines


def test_runtime_events_join_requests_by_request_id_or_trace_id(tmp_path: Path) -> None:
    src = tmp_path / "agent.events.jsonl"
    write_lines(src, LINES)
    store = Store(tmp_path / "s.duckdb")
    import_file(store, src)
    joined = [
        (row["event"]["type"], (row["request"] or {}).get("request_id"))
        for row in store.runtime_events(RUN)
    ]
    assert joined == [
        ("session_start", None),
        ("tool_call", f"{RUN}-001"),
        ("tool_call", f"{RUN}-001"),
        ("approval", f"{RUN}-002"),  # by trace_id
    ]
    # plain SQL joins work too (the typed columns are there for it)
    with duckdb.connect(str(store.path), read_only=True) as con:
        rows = con.execute(
            "SELECT r.type, e.request_id FROM runtime_events r JOIN events e "
            "ON e.request_id = r.request_id OR e.trace_id = r.trace_id ORDER BY r.seq"
        ).fetchall()
    assert sorted(rows) == [
        ("approval", f"{RUN}-002"),
        ("tool_call", f"{RUN}-001"),
        ("tool_call", f"{RUN}-001"),
    ]


def test_runtime_events_from_another_file_are_placed_by_time(tmp_path: Path) -> None:
    """Tailed or imported apart from the requests, an event lands where its time puts it."""
    requests = tmp_path / "requests.events.jsonl"
    write_lines(
        requests,
        [
            {"request_id": f"{RUN}-001", "ts": "2026-05-12T10:00:00Z", "ttft_ms": 1.0},
            {"request_id": f"{RUN}-002", "ts": "2026-05-12T10:00:10Z", "ttft_ms": 2.0},
        ],
    )
    agent = tmp_path / "agent.events.jsonl"
    tool = {"type": "tool_call", "run_id": RUN, "ts": "2026-05-12T10:00:04Z", "tool": "ls"}
    undated = {"type": "note", "run_id": RUN, "text": "no time"}
    write_lines(agent, [tool, undated])
    store = Store(tmp_path / "s.duckdb")
    import_file(store, agent)
    import_file(store, requests)
    out = tmp_path / "out.jsonl"
    assert export_run(store, RUN, out) == 4
    kinds = [
        d.get("type") or d["request_id"] for d in map(json.loads, out.read_text().split("\n")[:-1])
    ]
    assert kinds == [f"{RUN}-001", "tool_call", f"{RUN}-002", "note"]


def test_a_runtime_event_with_no_run_is_quarantined_with_a_reason(tmp_path: Path) -> None:
    src = tmp_path / "bad.events.jsonl"
    write_lines(src, [{"type": "tool_call", "tool": "ls"}, LINES[1]])
    store = Store(tmp_path / "s.duckdb")
    result = import_file(store, src)
    assert (result.events, result.runtime_events, result.errors) == (1, 0, 1)
    with duckdb.connect(str(store.path), read_only=True) as con:
        reason, raw = con.execute("SELECT reason, raw FROM ingest_errors").fetchone()
    assert "neither run_id nor request_id" in reason
    assert json.loads(raw) == {"type": "tool_call", "tool": "ls"}


def test_a_request_record_may_say_it_is_one() -> None:
    doc = parse_line(json.dumps({"type": "request", "request_id": "r-1", "ttft_ms": 3}))
    store_doc = {"request_id": "r-1", "type": "request", "ttft_ms": 3}
    assert doc == store_doc
