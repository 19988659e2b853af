"""The store on a real DuckDB file: round trips, idempotency, quarantine, merging."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb

from servescope.store import (
    Store,
)
from tests.helpers.cli import servescope
from tests.helpers.lines import SEED_LINE


def test_seed_line_round_trips_unchanged_through_the_cli(tmp_path: Path) -> None:
    src = tmp_path / "seed.events.jsonl"
    src.write_text(SEED_LINE + "\n")
    db = tmp_path / "s.duckdb"
    servescope("store", "import", str(src), "--store", str(db), check=True)
    servescope("store", "import", str(src), "--store", str(db), check=True)
    out = tmp_path / "out.events.jsonl"
    servescope("store", "export", "run-20260512", "--out", str(out), "--store", str(db), check=True)
    assert out.read_text() == src.read_text()
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM events").fetchone() == (1,)


def test_a_store_this_version_wrote_is_read_without_the_orm(tmp_path: Path) -> None:
    """The ORM takes a third of a second to import: a reader (`report build`) of a store this
    version stamped never imports it."""
    import subprocess
    import sys

    path = tmp_path / "s.duckdb"
    Store(path).add_events([{"request_id": "run-r-1"}])
    script = (
        "import sys; from servescope.store import Store; "
        f"assert Store({str(path)!r}).run_ids() == ['run-r'];"
        "print(sorted(m for m in ('sqlmodel', 'sqlalchemy') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_store_runs_lists_event_counts(tmp_path: Path) -> None:
    db = tmp_path / "s.duckdb"
    store = Store(db)
    store.add_events(
        [{"request_id": f"run-a-{i}", "model": "llama", "ts": f"2026-11-20T10:00:0{i}Z"}
         for i in range(3)]
    )  # fmt: skip
    store.upsert_run("run-b", model="m", levers={"enable_prefix_caching": False})
    for command in (("store", "runs"), ("report", "list")):
        listed = json.loads(servescope(*command, "--json", "--store", str(db), check=True).stdout)
        assert {(r["run_id"], r["events"]) for r in listed} == {("run-a", 3), ("run-b", 0)}
        # a file imported without a `runs` row: its model and times come from its events
        (imported,) = [r for r in listed if r["run_id"] == "run-a"]
        assert imported["model"] == "llama"
        assert (imported["started_at"], imported["ended_at"]) == (
            "2026-11-20 10:00:00", "2026-11-20 10:00:02"
        )  # fmt: skip
    # the table is the command's output: on stdout, as `report list` (`store runs | less`)
    for command in (("store", "runs"), ("report", "list")):
        table = servescope(*command, "--store", str(db), check=True).stdout
        assert "run-a" in table and "run-b" in table, command


def test_env_var_selects_the_store(tmp_path: Path) -> None:
    src = tmp_path / "seed.events.jsonl"
    src.write_text(SEED_LINE + "\n")
    db = tmp_path / "env.duckdb"
    servescope("store", "import", str(src), env={"SERVESCOPE_STORE": str(db)}, check=True)
    assert Store(db).run_ids() == ["run-20260512"]
