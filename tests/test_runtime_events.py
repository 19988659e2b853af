"""Agent-runtime lines in `.events.jsonl` files: stored (not quarantined), joinable to requests,
exported back unchanged and in place; and the hive-partitioned Parquet export."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb

from servescope.store import Store, export_run, import_file
from servescope.store.parquet import export_parquet
from servescope.store.validation import parse_line
from tests.conftest import servescope

RUN = "run-20260512"
TRACE = "0af7651916cd43dd8448eb211c80319c"
LINES = [
    {"type": "session_start", "run_id": RUN, "ts": "2026-05-12T09:59:59Z", "agent": "ralph"},
    {
        "request_id": f"{RUN}-001",
        "ts": "2026-05-12T10:00:00Z",
        "model": "local-coder",
        "prompt_tokens": 1842,
        "completion_tokens": 419,
        "ttft_ms": 820,
        "tpot_ms": 34,
        "cache_hit": True,
        "finish_reason": "stop",
    },
    {
        "type": "tool_call",
        "run_id": RUN,
        "ts": "2026-05-12T10:00:03Z",
        "request_id": f"{RUN}-001",
        "tool": "pytest",
        "args": {"k": "test_x", "n": 1.0},
    },
    # the same tool call twice is two events, not one
    {
        "type": "tool_call",
        "run_id": RUN,
        "ts": "2026-05-12T10:00:03Z",
        "request_id": f"{RUN}-001",
        "tool": "pytest",
        "args": {"k": "test_x", "n": 1.0},
    },
    {
        "request_id": f"{RUN}-002",
        "ts": "2026-05-12T10:00:05Z",
        "ttft_ms": 120.5,
        "finish_reason": "stop",
        "trace_id": TRACE,
    },
    {"type": "approval", "run_id": RUN, "trace_id": TRACE, "approved": True, "by": "é"},
]


def write_lines(path: Path, docs: list[dict]) -> str:
    text = "".join(json.dumps(doc, ensure_ascii=False) + "\n" for doc in docs)
    path.write_text(text, encoding="utf-8")
    return text


def test_runtime_and_request_lines_round_trip_unchanged_through_the_cli(tmp_path: Path) -> None:
    src = tmp_path / "agent.events.jsonl"
    text = write_lines(src, LINES)
    db = tmp_path / "s.duckdb"
    for _ in range(2):  # idempotent: importing twice changes nothing
        result = servescope("store", "import", str(src), "--store", str(db), "--json", check=True)
        counts = json.loads(result.stdout)
        assert (counts["events"], counts["runtime_events"], counts["errors"]) == (2, 4, 0)
    out = tmp_path / "out.events.jsonl"
    servescope("store", "export", RUN, "--out", str(out), "--store", str(db), check=True)
    assert out.read_text(encoding="utf-8") == text
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM events").fetchone() == (2,)
        assert con.execute("SELECT count(*) FROM runtime_events").fetchone() == (4,)
        assert con.execute("SELECT count(*) FROM ingest_errors").fetchone() == (0,)


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


def test_parquet_export_is_hive_partitioned_and_reads_back_the_same_counts(tmp_path: Path) -> None:
    src = tmp_path / "agent.events.jsonl"
    write_lines(src, LINES)
    other = tmp_path / "other.events.jsonl"
    write_lines(
        other,
        [
            {"request_id": f"run-20260513-{i:03d}", "ts": f"2026-05-1{3 + i % 2}T10:00:00Z"}
            for i in range(5)
        ],
    )
    db = tmp_path / "s.duckdb"
    servescope("store", "import", str(src), str(other), "--store", str(db), check=True)
    out = tmp_path / "parquet"
    result = servescope(
        "store",
        "export",
        "--format",
        "parquet",
        "--out",
        str(out),
        "--store",
        str(db),
        "--json",
        check=True,
    )
    counts = json.loads(result.stdout)
    assert counts["written"] == {"events": 7, "runtime_events": 4}
    assert counts["read_back"] == counts["written"]
    dirs = {p.relative_to(out / "events").as_posix() for p in (out / "events").glob("*/*")}
    assert {
        "run_id=run-20260513/date=2026-05-13",
        "run_id=run-20260513/date=2026-05-14",
        "run_id=run-20260512/date=2026-05-12",
    } <= dirs
    with duckdb.connect() as con:
        glob = str(out / "events" / "**" / "*.parquet")
        per_run = con.execute(
            "SELECT run_id, count(*) FROM read_parquet(?, hive_partitioning = true) "
            "GROUP BY run_id ORDER BY run_id",
            [glob],
        ).fetchall()
        with duckdb.connect(str(db), read_only=True) as store_con:
            expected = store_con.execute(
                "SELECT run_id, count(*) FROM events GROUP BY run_id ORDER BY run_id"
            ).fetchall()
        assert per_run == expected
        docs = con.execute(
            "SELECT doc FROM read_parquet(?, hive_partitioning = true) WHERE request_id = ?",
            [glob, f"{RUN}-002"],
        ).fetchall()
        assert json.loads(docs[0][0]) == LINES[4]
    # one run only, into its own folder
    one = tmp_path / "one"
    written = export_parquet(Store(db), one, "run-20260513")
    assert written == {"events": 5, "runtime_events": 0}


def test_export_needs_a_run_for_jsonl_and_a_known_run(tmp_path: Path) -> None:
    db = tmp_path / "s.duckdb"
    src = tmp_path / "a.jsonl"
    write_lines(src, LINES)
    servescope("store", "import", str(src), "--store", str(db), check=True)
    assert (
        servescope("store", "export", "--out", str(tmp_path / "x"), "--store", str(db)).returncode
        == 2
    )
    missing = servescope(
        "store",
        "export",
        "run-nope",
        "--format",
        "parquet",
        "--out",
        str(tmp_path / "p"),
        "--store",
        str(db),
    )
    assert missing.returncode == 2


def test_the_collector_tailing_the_file_stores_and_exports_it_the_same(tmp_path: Path) -> None:
    """`servescope collect` (tailing `.events.jsonl` files) routes runtime lines the same way."""
    src = tmp_path / "agent.events.jsonl"
    text = write_lines(src, LINES)
    db = tmp_path / "s.duckdb"
    servescope("collect", "--once", "--events", str(src), "--store", str(db), check=True)
    out = tmp_path / "out.events.jsonl"
    servescope("store", "export", RUN, "--out", str(out), "--store", str(db), check=True)
    assert out.read_text(encoding="utf-8") == text
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM runtime_events").fetchone() == (4,)
        assert con.execute("SELECT count(*) FROM ingest_errors").fetchone() == (0,)
