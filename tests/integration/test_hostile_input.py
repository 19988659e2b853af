"""Hostile input (issue 15): a corpus of line shapes other people's files hold, through every way
a line enters the store — `servescope store import` and `servescope collect --once` as a user
runs them, on a real DuckDB file — plus the collector tailing a file that gets a poison line
while it runs. Each shape is a line of its own request, so the counts are exact: every good line
is one stored request, every bad one is one `ingest_errors` row with a reason, no command
prints a traceback, and nothing is written outside the folders named on the command line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import pytest

from servescope.collector import Collector, FlushReport
from servescope.collector.sources.events import EventsFiles
from servescope.store import Store
from servescope.store.paths import name_of, safe_name
from tests.helpers.cli import ROOT
from tests.helpers.cli import servescope as _servescope

DEEP = 100_000
ODD_RUN_IDS = [
    "../../escape", "a/b", "x\x00y", "r" * 300, "😀 run", "..", ".", "-000001",
    "[/]x", "[bold red]team",  # rich markup: a terminal message must print it, not parse it
]  # fmt: skip


def servescope(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI of this tree, from any working folder."""
    return _servescope(*args, cwd=cwd, env={"PYTHONPATH": str(ROOT)})


def _j(doc: object) -> bytes:
    return json.dumps(doc).encode()


def _nested(arrays: int) -> str:
    return "[" * arrays + "1" + "]" * arrays  # inside the line's object: depth arrays + 1


# (name, line, good?) — a good line is a request of its own; a bad one is refused with a reason
CORPUS: list[tuple[str, bytes, bool]] = [
    ("byte-order mark", b"\xef\xbb\xbf" + _j({"request_id": "bom-000001", "ttft_ms": 5}), True),
    (
        "seed format",
        _j(
            {
                "request_id": "run-20260512-001",
                "model": "local-coder",
                "prompt_tokens": 1842,
                "completion_tokens": 419,
                "ttft_ms": 820,
                "tpot_ms": 34,
                "cache_hit": True,
                "finish_reason": "stop",
            }
        ),
        True,
    ),
    ("CRLF ending", _j({"request_id": "crlf-000001", "ttft_ms": 5}) + b"\r", True),
    ("whitespace and tabs", b'{ "request_id" :\t"ws-000001" ,  "ttft_ms" : 1 }', True),
    (
        "first value of a repeated key wins",
        b'{"request_id":"dup-000001","ttft_ms":5,"ttft_ms":"x"}',
        True,
    ),
    ("number beyond a double outside the contract", b'{"request_id":"big-000001","x":1e999}', True),
    (
        "40-digit integer outside the contract",
        b'{"request_id":"int-000001","x":' + b"1" * 40 + b"}",
        True,
    ),
    ("nested 64 deep", f'{{"request_id":"d64-000001","x":{_nested(63)}}}'.encode(), True),
    ("surrogate pair escape", b'{"request_id":"emoji-000001","x":"\\ud83d\\ude00"}', True),
    ("zero and negative zero", b'{"request_id":"zero-000001","ttft_ms":0,"tpot_ms":-0.0}', True),
    ("request id that is all sequence", _j({"request_id": "-000001", "ttft_ms": 1}), True),
    *[
        (
            f"run id {rid[:12]!r}",
            _j(
                {
                    "request_id": f"odd{i}-000001",
                    "run_id": rid,
                    "ttft_ms": 10.0 + i,
                    "ts": "2026-11-22T04:29:59Z",
                }
            ),
            True,
        )
        for i, rid in enumerate(ODD_RUN_IDS)
    ],
    ("100,000-deep array", b"[" * DEEP, False),
    ("nested 65 deep", f'{{"request_id":"d65-000001","x":{_nested(64)}}}'.encode(), False),
    ("ttft NaN", b'{"request_id":"nan-000001","ttft_ms":NaN}', False),
    ("ttft Infinity", b'{"request_id":"inf-000001","ttft_ms":Infinity}', False),
    ("ttft -Infinity", b'{"request_id":"ninf-000001","ttft_ms":-Infinity}', False),
    ("ttft 1e999", b'{"request_id":"e999-000001","ttft_ms":1e999}', False),
    ("ttft -5", b'{"request_id":"neg-000001","ttft_ms":-5}', False),
    ("nan outside the contract", b'{"request_id":"nan2-000001","x":nan}', False),
    ("INF outside the contract", b'{"request_id":"inf2-000001","x":[1,-INF]}', False),
    ("trailing comma in the object", b'{"request_id":"tc-000001","ttft_ms":5,}', False),
    ("trailing comma in an array", b'{"request_id":"tc2-000001","x":[1,2,]}', False),
    ("prompt_tokens 1.5", b'{"request_id":"pt-000001","prompt_tokens":1.5}', False),
    ("prompt_tokens -1", b'{"request_id":"pt2-000001","prompt_tokens":-1}', False),
    ("prompt_tokens 2**31", b'{"request_id":"pt3-000001","prompt_tokens":2147483648}', False),
    ("prompt_tokens as a string", b'{"request_id":"pt4-000001","prompt_tokens":"12"}', False),
    ("completion_tokens true", b'{"request_id":"ct-000001","completion_tokens":true}', False),
    ("itl_ms with a negative gap", b'{"request_id":"itl-000001","itl_ms":[1,-2]}', False),
    ("itl_ms with a string", b'{"request_id":"itl2-000001","itl_ms":[1,"2"]}', False),
    ("http_status 42", b'{"request_id":"hs-000001","http_status":42}', False),
    ("cache_hit as a string", b'{"request_id":"ch-000001","cache_hit":"yes"}', False),
    ("unknown status", b'{"request_id":"st-000001","status":"weird"}', False),
    ("empty request_id", b'{"request_id":"","ttft_ms":1}', False),
    ("numeric request_id", b'{"request_id":7,"ttft_ms":1}', False),
    ("no request_id", b'{"ttft_ms":1}', False),
    ("invalid UTF-8", b'{"request_id":"utf-000001","model":"\xff\xfe"}', False),
    ("half a surrogate pair", b'{"request_id":"sur-000001","x":"\\ud800"}', False),
    ("raw control character", b'{"request_id":"ctl-000001","x":"a\x01b"}', False),
    ("raw NUL byte", b'{"request_id":"nul-000001"}\x00', False),
    ("two objects on one line", b'{"request_id":"two-000001"} {"request_id":"two-000002"}', False),
    ("an array of the object", b'[{"request_id":"arr-000001"}]', False),
    ("a string", b'"request_id"', False),
    ("null", b"null", False),
    ("truncated", b'{"request_id":"tr-000001","ttft_ms":', False),
    ("single quotes", b"{'request_id':'sq-000001'}", False),
    ("comment", b'{"request_id":"cm-000001" /* c */}', False),
    ("2 MiB line", b'{"request_id":"long-000001","x":"' + b"a" * (2 << 20) + b'"}', False),
]
GOOD = sum(1 for _n, _l, good in CORPUS if good)
BAD = len(CORPUS) - GOOD


def _write_corpus(path: Path) -> None:
    """The corpus, one line each, with blank and whitespace-only lines between (not counted;
    a vertical tab or a form feed is as blank to `str.strip` as a space)."""
    with path.open("wb") as fh:
        for i, (_name, line, _good) in enumerate(CORPUS):
            fh.write(line + b"\n")
            if i % 10 == 3:
                fh.write(b"\n   \n\x0b\n \x0c\t\n")


def _files_under(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*") if p.is_file()}


def _stored(store: Path) -> tuple[list[tuple], list[tuple]]:
    with duckdb.connect(str(store), read_only=True) as con:
        columns = con.execute(
            "SELECT * EXCLUDE (doc) FROM events ORDER BY run_id, request_id"
        ).fetchall()
        errors = con.execute('SELECT "offset", reason, raw FROM ingest_errors ORDER BY 1')
        errors = errors.fetchall()
    return columns, errors


def test_corpus_has_thirty_shapes_of_each_kind() -> None:
    assert GOOD >= 15 and BAD >= 30 and len(CORPUS) >= 30


@pytest.fixture(scope="module")
def ingested(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The corpus through `store import` and through `collect --once`, each into its own store,
    from a working folder nested three deep (a `../..` escape would land inside `tmp`)."""
    tmp = tmp_path_factory.mktemp("hostile")
    work = tmp / "a" / "b" / "c"
    work.mkdir(parents=True)
    corpus = work / "corpus.events.jsonl"
    _write_corpus(corpus)
    imported = servescope(
        "store", "import", str(corpus), "--store", "imported.duckdb", "--json", cwd=work
    )
    collected = servescope(
        "collect", "--once", "--events", str(corpus), "--store", "collected.duckdb",
        "--json", "--metrics-port", "0", cwd=work,
    )  # fmt: skip
    return {"tmp": tmp, "work": work, "imported": imported, "collected": collected}


def _assert_counts_exact(result: subprocess.CompletedProcess[str]) -> None:
    """A command's run over the corpus: exit 0, no traceback, and its JSON totals exact."""
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    totals = json.loads(result.stdout.strip().splitlines()[-1])
    assert (totals["events"], totals["errors"]) == (GOOD, BAD)


def test_store_import_counts_are_exact(ingested: dict) -> None:
    _assert_counts_exact(ingested["imported"])
    columns, errors = _stored(ingested["work"] / "imported.duckdb")
    assert len(columns) == GOOD and len(errors) == BAD
    reasons = [reason for _o, reason, _raw in errors]
    assert all(reasons) and not any("Traceback" in r for r in reasons)
    assert any(r.startswith("nested deeper than 64") for r in reasons)
    assert any("NaN and Infinity are not JSON" in r for r in reasons)
    assert any(r.startswith("line too long (2097") for r in reasons)
    assert any(r.startswith("ttft_ms is -5") for r in reasons)
    # the raw bytes are kept, bounded, with the length of what was cut
    deep = next(raw for _o, r, raw in errors if r.startswith("nested deeper"))
    assert deep.startswith("[[[[") and deep.endswith(f"[{DEEP} bytes, cut]")
    assert max(len(raw) for _o, _r, raw in errors) < 70_000


def test_collect_once_stores_what_import_stores(ingested: dict) -> None:
    _assert_counts_exact(ingested["collected"])
    imported, import_errors = _stored(ingested["work"] / "imported.duckdb")
    collected, collect_errors = _stored(ingested["work"] / "collected.duckdb")
    assert str(collected) == str(imported)  # same rows, same typed columns: one rule set
    assert [r for _o, r, _raw in collect_errors if not r.startswith("line too long")] == [
        r for _o, r, _raw in import_errors if not r.startswith("line too long")
    ]
    assert [o for o, _r, _raw in collect_errors] == [o for o, _r, _raw in import_errors]
    for row in collected:  # nothing non-finite or negative reaches a percentile
        for value in row:
            if isinstance(value, float):
                assert value == value and abs(value) != float("inf") and value >= 0


def test_a_repeated_key_is_read_first_wins_by_both_paths(ingested: dict) -> None:
    for name in ("imported.duckdb", "collected.duckdb"):
        with duckdb.connect(str(ingested["work"] / name), read_only=True) as con:
            row = con.execute("SELECT ttft_ms FROM events WHERE request_id = 'dup-000001'")
            assert row.fetchone() == (5.0,)


def test_reports_and_exports_of_odd_run_ids_stay_inside_their_folders(ingested: dict) -> None:
    work: Path = ingested["work"]
    tmp: Path = ingested["tmp"]
    before = _files_under(tmp)
    for rid in ODD_RUN_IDS:
        arg = rid if "\x00" not in rid else safe_name(rid)  # a NUL cannot be typed
        result = servescope(
            "report", "build", arg, "--store", "collected.duckdb", "--out", "out", "--json",
            cwd=work,
        )  # fmt: skip
        assert result.returncode == 0, (rid, result.stderr)
        assert "Traceback" not in result.stderr
        brief = json.loads(result.stdout)
        assert brief["report_id"] == rid
        for path in map(Path, brief["paths"]):
            assert (work / path).resolve().parent.parent == (work / "out").resolve()
            assert name_of((work / path).parent.name) in (rid, None)
        report = json.loads((work / brief["paths"][-1]).read_text())
        requests = 2 if rid == "-000001" else 1  # also the line whose request_id is "-000001"
        assert report["run_id"] == rid and report["overall"]["requests"] == requests
    diff = servescope(
        "report", "build", "a/b", "--vs", "../../escape", "--store", "collected.duckdb",
        "--out", "out", "--json", cwd=work,
    )  # fmt: skip
    assert diff.returncode == 0, diff.stderr
    exported = servescope(
        "store", "export", "--format", "parquet", "--out", "pq", "--store", "collected.duckdb",
        "--json", cwd=work,
    )  # fmt: skip
    assert exported.returncode == 0, exported.stderr
    counts = json.loads(exported.stdout)
    assert counts["written"] == counts["read_back"] and counts["written"]["events"] == GOOD
    with duckdb.connect() as con:
        ids = con.execute(
            "SELECT DISTINCT run_id FROM read_parquet(?, hive_partitioning = true)",
            [str(work / "pq" / "events" / "**" / "*.parquet")],
        ).fetchall()
    assert {"../../escape", "a/b", "x\x00y", "😀 run"} <= {r for (r,) in ids}
    for rid in ("a/b", "x\x00y"):
        out = work / f"export-{safe_name(rid)}.events.jsonl"
        result = servescope(
            "store", "export", safe_name(rid), "--out", str(out), "--store", "collected.duckdb",
            cwd=work,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert json.loads(out.read_text())["run_id"] == rid
    new = _files_under(tmp) - before
    allowed = (work / "out", work / "pq")
    for path in new:
        assert path.parent == work or any(p in path.parents for p in allowed), path


def test_listings_print_odd_run_ids_as_they_are(ingested: dict) -> None:
    """Run ids are data in a terminal too: listed literally, never read as markup."""
    work: Path = ingested["work"]
    store = ("--store", "collected.duckdb")
    for args in (("store", "runs"), ("report", "list"), ("report", "flips")):
        result = servescope(*args, *store, cwd=work)
        assert result.returncode == 0 and "Traceback" not in result.stderr, (args, result.stderr)
        if args != ("report", "flips"):
            shown = result.stdout + result.stderr
            assert "[/]x" in shown and "[bold red]team" in shown, args
    unknown = servescope("store", "export", "no-such-run", "--out", "x.jsonl", *store, cwd=work)
    assert unknown.returncode == 2 and "[/]x" in unknown.stderr, unknown.stderr


def test_no_command_prints_a_traceback_on_bad_paths_or_stores(tmp_path: Path) -> None:
    not_a_store = tmp_path / "not-a-store.duckdb"
    not_a_store.write_bytes(b"\x00garbage" * 100)
    cases = [
        ("store", "import", str(tmp_path), "--store", str(tmp_path / "s.duckdb")),
        ("store", "import", "/dev/null", "--store", str(not_a_store)),
        ("report", "build", "x", "--store", str(not_a_store)),
        ("report", "list", "--store", str(not_a_store)),
        ("store", "runs", "--store", str(tmp_path)),
    ]
    for args in cases:
        result = servescope(*args)
        assert result.returncode in (1, 2), (args, result.returncode)
        assert "Traceback" not in result.stderr + result.stdout, (args, result.stderr)
        assert result.stderr.strip(), args


def test_a_reading_command_refuses_a_store_that_is_not_there(tmp_path: Path) -> None:
    """A mistyped --store made an empty store and listed nothing, exit 0: now exit 2, said so,
    and no file made."""
    typo = tmp_path / "typo.duckdb"
    cases = [
        ("report", "list"), ("report", "flips"), ("report", "build", "x"), ("store", "runs"),
        ("store", "export", "x", "--out", str(tmp_path / "x.jsonl")), ("diagnose", "x"),
    ]  # fmt: skip
    for args in cases:
        result = servescope(*args, "--store", str(typo))
        assert result.returncode == 2, (args, result.returncode, result.stderr)
        assert f"no store at {typo}" in result.stderr, (args, result.stderr)
    assert list(tmp_path.iterdir()) == []


POISONS = [
    b"[" * DEEP,
    b'{"request_id":"p-000001","ttft_ms":NaN}',
    b'{"request_id":"p-000002","model":"\xff"}',
    b'{"request_id":"p-000003","x":[1,]}',
    b'{"request_id":"p-000004","x":"' + b"y" * (2 << 20) + b'"}',
]


def test_the_collector_tailing_a_poison_line_keeps_ingesting_what_follows(tmp_path: Path) -> None:
    """Lines after a poison line are stored by the flush that quarantines it (and the next
    ones, where the collector read the write in parts)."""
    path = tmp_path / "live.events.jsonl"
    path.write_bytes(b"")
    store = Store(tmp_path / "s.duckdb")
    collector = Collector(store, [EventsFiles(str(path))], flush_interval=0.05)
    reports: list[FlushReport] = []
    flushed = threading.Event()

    def on_flush(report: FlushReport) -> None:
        reports.append(report)
        flushed.set()

    collector.exporters.append(on_flush)
    stop = threading.Event()
    loop = threading.Thread(target=collector.run, args=(stop,), daemon=True)
    loop.start()
    try:
        for round_, poison in enumerate(POISONS):
            after = [_j({"request_id": f"after{round_}-{i:06d}", "ttft_ms": i}) for i in range(50)]
            flushed.clear()
            reports.clear()
            with path.open("ab") as fh:  # one write: the poison and what follows it
                fh.write(b"\n".join([poison, *after]) + b"\n")
            deadline = time.monotonic() + 30
            while sum(r.events for r in list(reports)) < 50 and time.monotonic() < deadline:
                flushed.wait(0.1)
                flushed.clear()
            seen = list(reports)
            # the flush that met the poison; nothing after it in the file was stored before it
            first = next((i for i, r in enumerate(seen) if r.errors), len(seen))
            assert not any(r.events for r in seen[:first]), (round_, seen)
            totals = (sum(r.errors for r in seen), sum(r.events for r in seen))
            assert totals == (1, 50), (round_, seen)
            assert loop.is_alive()
    finally:
        stop.set()
        loop.join(timeout=60)
    with duckdb.connect(str(tmp_path / "s.duckdb"), read_only=True) as con:
        stored = con.execute("SELECT count(*) FROM events").fetchone()
        refused = con.execute("SELECT count(*) FROM ingest_errors").fetchone()
    assert stored == (50 * len(POISONS),) and refused == (len(POISONS),)


def test_the_sidecar_survives_poison_in_every_source(tmp_path: Path) -> None:
    """`servescope collect` as a process: a poison events line and a poison log line, then good
    lines; the process stays up, stores what follows and exits 0 on SIGTERM."""
    events = tmp_path / "e.events.jsonl"
    log = tmp_path / "vllm.log"
    events.write_bytes(b"")
    log.write_bytes(b"")
    store = tmp_path / "s.duckdb"
    proc = subprocess.Popen(
        [sys.executable, "-m", "servescope.cli", "collect", "--events", str(events),
         "--vllm-log", str(log), "--store", str(store), "--metrics-port", "0", "--json"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        time.sleep(1.0)
        with events.open("ab") as fh:
            fh.write(b"[" * DEEP + b"\n" + _j({"request_id": "live-000001", "ttft_ms": 3}) + b"\n")
        prefix = "(APIServer pid=7) INFO 11-22 04:29:59 [logger.py:1] "
        with log.open("ab") as fh:
            fh.write(b'{"message": ' + b"[" * DEEP + b"\n")
            fh.write((prefix + "Received request cmpl-live-000002-0: params: x\n").encode())
        deadline = time.monotonic() + 60
        rows: list[tuple] = []
        while time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                with duckdb.connect(str(store), read_only=True) as con:
                    rows = con.execute("SELECT request_id FROM events ORDER BY 1").fetchall()
            except duckdb.IOException:
                continue  # the collector holds the file for a flush
            if len(rows) == 2:
                break
        assert rows == [("live-000001",), ("live-000002",)]
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "Traceback" not in out + err
    assert json.loads(out.strip().splitlines()[-1])["errors"] == 2
    assert os.path.exists(store)
