"""Agent-runtime lines in `.events.jsonl` files: stored (not quarantined), joinable to requests,
exported back unchanged and in place; and the hive-partitioned Parquet export."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb

from servescope.store import Store
from servescope.store.parquet import export_parquet
from tests.helpers.cli import servescope
from tests.helpers.runtime_lines import LINES, RUN, write_lines


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
