"""The store on a real DuckDB file: round trips, idempotency, quarantine, merging."""

from __future__ import annotations

import itertools
import json
import types
import typing
from datetime import datetime
from pathlib import Path
from typing import TypedDict

import duckdb
import msgspec
import msgspec.inspect as mi
import pytest
from sqlmodel import SQLModel

from servescope.reports import sql
from servescope.store import (
    Store,
    bulk,
    export_run,
    import_file,
    merge_docs,
    run_id_of,
    schema_sql,
    tables,
)
from servescope.store.db import schema_stamp
from servescope.store.schema import TABLES, Event
from servescope.store.validation import EventDoc, InvalidEvent, RequestEvent, parse_line
from tests.helpers.lines import SEED_LINE


def test_unknown_keys_and_order_are_preserved(tmp_path: Path) -> None:
    doc = {"zeta": [1, {"a": None}], "request_id": "run-x-7", "ttft_ms": 1.5, "custom": "é"}
    src = tmp_path / "in.events.jsonl"
    src.write_text(json.dumps(doc) + "\n")
    store = Store(tmp_path / "s.duckdb")
    import_file(store, src)
    out = tmp_path / "out.jsonl"
    export_run(store, "run-x", out)
    assert list(json.loads(out.read_text()).items()) == list(doc.items())


def test_bad_lines_are_quarantined_with_reasons_and_good_ones_kept(tmp_path: Path) -> None:
    lines = [
        SEED_LINE,
        '{"request_id": "run-20260512-002", "ttft_ms": ',
        "\x00\x01garbage",
        '{"request_id": "run-20260512-003", "ttft_ms": "fast"}',
        '{"model": "no id"}',
        '{"request_id": "run-20260512-004", "ttft_ms": 5, "brand_new_field": {"x": 1}}',
    ]
    src = tmp_path / "mixed.events.jsonl"
    src.write_text("\n".join(lines) + "\n")
    store = Store(tmp_path / "s.duckdb")
    result = import_file(store, src)
    assert (result.events, result.errors) == (2, 4)
    with store.read() as con:
        ids = [r[0] for r in con.execute("SELECT request_id FROM events ORDER BY 1").fetchall()]
        errors = con.execute('SELECT "offset", reason FROM ingest_errors ORDER BY 1').fetchall()
    assert ids == ["run-20260512-001", "run-20260512-004"]
    reasons = [reason for _, reason in errors]
    assert reasons[0].startswith("invalid JSON")
    assert reasons[1].startswith("invalid JSON")
    assert reasons[2] == "wrong type for ttft_ms: str"
    assert reasons[3] == "missing request_id"
    assert errors[0][0] == len(lines[0]) + 1


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ('{"request_id": "a-1", "cache_hit": 1}', "wrong type for cache_hit: int"),
        ('{"request_id": "a-1", "prompt_tokens": true}', "wrong type for prompt_tokens: bool"),
        ('{"request_id": "a-1", "status": "great"}', "unknown status: 'great'"),
        (
            '{"request_id": "a-1", "itl_ms": [1, "x"]}',
            "wrong type for itl_ms: not a list of numbers",
        ),
        ("[1, 2]", "not a JSON object but an array"),
    ],
)
def test_contract_types_are_enforced(line: str, reason: str) -> None:
    with pytest.raises(InvalidEvent, match=reason.replace("[", r"\[")):
        parse_line(line)


def test_run_id_defaults_to_request_id_without_sequence() -> None:
    assert run_id_of({"request_id": "run-20260512-001"}) == "run-20260512"
    assert run_id_of({"request_id": "run-20260512-demo-000042"}) == "run-20260512-demo"
    assert run_id_of({"request_id": "x-1", "run_id": "other"}) == "other"


def test_pieces_of_one_request_merge_into_one_row(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    store.add_events(
        [{"request_id": "run-m-1", "source": "client", "ttft_ms": 12.0, "e2e_ms": 50.0}]
    )
    store.add_events(
        [{"request_id": "run-m-1", "source": "vllm-trace", "queue_ms": 3.0, "ttft_ms": None}]
    )
    [doc] = store.export_events("run-m")
    assert doc == {
        "request_id": "run-m-1",
        "source": "client",
        "ttft_ms": 12.0,
        "e2e_ms": 50.0,
        "queue_ms": 3.0,
    }
    with store.read() as con:
        assert con.execute("SELECT ttft_ms, queue_ms, status FROM events").fetchall() == [
            (12.0, 3.0, "ok")
        ]


def test_a_store_whose_events_had_a_primary_key_is_rebuilt_without_it(tmp_path: Path) -> None:
    path = tmp_path / "old.duckdb"
    with duckdb.connect(str(path)) as con:  # `events` as stores made before had it
        ddl = tables.create_statements()[0]
        ddl = ddl.replace("doc VARCHAR USING COMPRESSION zstd", "doc JSON")
        con.execute(ddl.rstrip().rstrip(")") + ", PRIMARY KEY (run_id, request_id))")
        con.execute(
            "INSERT INTO events (run_id, request_id, ttft_ms, doc) "
            """VALUES ('run-k', 'run-k-1', 5, '{"request_id": "run-k-1", "ttft_ms": 5}')"""
        )
    store = Store(path)
    store.add_events([{"request_id": "run-k-1", "e2e_ms": 9}, {"request_id": "run-k-2"}])
    store.add_events([{"request_id": "run-k-2"}])  # a key already stored, by the new table
    assert store.export_events("run-k") == [
        {"request_id": "run-k-1", "ttft_ms": 5, "e2e_ms": 9},
        {"request_id": "run-k-2"},
    ]
    with store.read() as con:
        assert con.execute(
            "SELECT count(*) FROM duckdb_constraints() "
            "WHERE constraint_type = 'PRIMARY KEY' "
            "AND table_name = 'events'"
        ).fetchone() == (0,)


OOM_DETAILS = [  # (error_detail, counted as out of memory)
    ('{"object": "error", "message": "CUDA out of memory. Tried to allocate 2.00 GiB"}', True),
    ("torch.OutOfMemoryError: KV cache", True),
    ({"code": 500, "message": "OOM while decoding"}, True),  # any JSON value, kept as its text
    ("upstream closed the connection", False),
    (None, False),
]


def _oom_docs(run: str) -> list[dict]:
    docs = []
    for i, (detail, _oom) in enumerate(OOM_DETAILS):
        doc = {"request_id": f"{run}-{i}", "status": "error", "error": "http_5xx"}
        if detail is not None:
            doc["error_detail"] = detail
        docs.append(doc)
    return docs


def _ooms(store: Store, run: str) -> int:
    params = {"run_id": run, "since": None, "until": None}
    with store.read() as con:
        row = con.execute(sql.SLICE_OOMS, params).fetchone()
    return row[0] if row else -1


def test_out_of_memory_failures_are_counted_from_their_detail_on_both_paths(
    tmp_path: Path,
) -> None:
    """The checklist counts a failure as out of memory by its class or its kept message, on
    the `error_detail` column that the bulk statement and the ordinary path both fill."""
    store = Store(tmp_path / "s.duckdb")
    store.add_events(_oom_docs("run-slow"))
    lines = b"".join(json.dumps(d).encode() + b"\n" for d in _oom_docs("run-bulk"))
    with store.write() as con:
        assert bulk.ingest_lines(store, con, lines, source="f", offset=0).events == len(
            lines.splitlines()
        )
    expected = sum(oom for _detail, oom in OOM_DETAILS)
    assert (_ooms(store, "run-slow"), _ooms(store, "run-bulk")) == (expected, expected)
    with store.read() as con:
        details = con.execute(
            "SELECT run_id, list(error_detail ORDER BY request_id) FROM events"
            " GROUP BY 1 ORDER BY 1"
        ).fetchall()
    assert details[0][1] == details[1][1]  # the same text from both paths


def _file_columns(path: Path, table: str) -> list[tuple[str, str]]:
    """The columns a store file has, as DuckDB describes them, in their order."""
    with duckdb.connect(str(path), read_only=True) as con:
        return con.execute(
            "SELECT column_name, data_type FROM duckdb_columns() WHERE table_name = ?"
            " ORDER BY column_index",
            [table],
        ).fetchall()


def test_the_sqlmodel_classes_are_the_tables_of_a_store_file(tmp_path: Path) -> None:
    """SQLModel's classes are the one definition of the tables: the columns derived from them
    (names from the classes' fields, types as DuckDB names them) are what a store file has."""
    path = tmp_path / "s.duckdb"
    Store(path).add_events([{"request_id": "run-t-1"}])
    for model in TABLES:
        derived = tables.columns(model)
        assert [name for name, _type in derived] == list(model.model_fields), model
        assert _file_columns(path, model.__tablename__) == derived, model
    # the statements name every column of `events`, in the schema's order
    names = ", ".join(name for name, _type in tables.columns(TABLES[0]))
    assert f"INSERT INTO events ({names})" in schema_sql.insert_staged_events()


def test_the_cached_sql_is_what_the_classes_give(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writers read the DDL and columns from a cache (store/schema_sql.py), never a second
    definition: what it holds is what the classes derive, and a cache file that is damaged, or
    names no table, is derived again and rewritten."""
    derived = schema_sql.derive()
    assert schema_sql.schema_sql() == derived
    assert derived.create == tables.create_statements()
    assert derived.columns == {m.__tablename__: tables.columns(m) for m in TABLES}
    cached = tmp_path / "schema_sql.json"
    monkeypatch.setattr(schema_sql, "cache_path", lambda: cached)
    for damage in ("", "{", '{"create": [], "columns": {}}', '{"create": 1}', "[]"):
        cached.write_text(damage)
        schema_sql.schema_sql.cache_clear()
        assert schema_sql.schema_sql() == derived, damage
        assert json.loads(cached.read_text())["create"] == derived.create
    schema_sql.schema_sql.cache_clear()


# Columns added since the first stores, and how an older store's rows get them.
ADDED = [("events", "server_ttft_ms"), ("events", "server_e2e_ms"), ("events", "vllm_session"),
         ("events", "error_detail"), ("events", "server_tpot_ms"),
         ("lever_flips", "before_run_id")]  # fmt: skip


def test_columns_added_since_a_store_was_made_are_filled_from_its_documents(
    tmp_path: Path,
) -> None:
    """A store an older version made lacks the newer columns, and carries no stamp of this
    schema: the first read adds them (derived from the classes), filled from the documents."""
    path = tmp_path / "old.duckdb"
    doc = {**_oom_docs("run-o")[0], "server_ttft_ms": 7, "vllm_session": "v", "server_tpot_ms": 2}
    Store(path).add_events([doc])
    with duckdb.connect(str(path)) as con:  # the store as a version before those columns made it
        for table, column in ADDED:
            con.execute(f'ALTER TABLE {table} DROP COLUMN "{column}"')
        con.execute("COMMENT ON TABLE events IS NULL")
    store = Store(path)
    assert _ooms(store, "run-o") == 1
    with store.read() as con:
        row = con.execute("SELECT server_ttft_ms, vllm_session, server_tpot_ms FROM events")
        assert row.fetchone() == (7.0, "v", 2.0)
        stamp = con.execute("SELECT comment FROM duckdb_tables() WHERE table_name = 'events'")
        assert stamp.fetchone() == (schema_stamp(),)
    for model in TABLES:  # every column, the added ones at the end
        assert sorted(_file_columns(path, model.__tablename__)) == sorted(tables.columns(model))


def test_status_is_derived_when_absent(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    store.add_events(
        [
            {"request_id": "r-1", "finish_reason": "stop"},
            {"request_id": "r-2", "finish_reason": "error"},
            {"request_id": "r-3", "error": "http_5xx"},
            {"request_id": "r-4", "status": "rejected", "error": "rejected:queue_full"},
        ]
    )
    with store.read() as con:
        rows = con.execute("SELECT request_id, status FROM events ORDER BY 1").fetchall()
    assert rows == [("r-1", "ok"), ("r-2", "error"), ("r-3", "error"), ("r-4", "rejected")]


def test_counter_deltas_are_run_scoped_and_survive_a_restart(tmp_path: Path) -> None:
    from datetime import datetime, timedelta

    store = Store(tmp_path / "s.duckdb")
    t0 = datetime(2026, 5, 12)
    hits = [(0, 0), (10, 40), (30, 100), (5, 10), (15, 30)]  # server restarted after sample 3
    rows = []
    for i, (h, q) in enumerate(hits):
        ts = t0 + timedelta(seconds=i)
        labels = {"model_name": "m"}
        rows.append((ts, "a", "vllm:prefix_cache_hits_total", labels, "r1", h))
        rows.append((ts, "a", "vllm:prefix_cache_queries_total", labels, "r1", q))
        rows.append((ts, "a", "vllm:num_requests_waiting", labels, "r1", float(i)))
        rows.append((ts, "a", "vllm:prefix_cache_hits_total", labels, "other-run", 999.0 * i))
    store.add_metric_samples(rows)
    deltas = store.counter_deltas(
        "r1", ["vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "absent"]
    )
    assert deltas == {
        "vllm:prefix_cache_hits_total": 45.0,
        "vllm:prefix_cache_queries_total": 130.0,
        "absent": None,
    }
    assert store.gauge_peaks("r1", ["vllm:num_requests_waiting"]) == {
        "vllm:num_requests_waiting": 4.0
    }


def test_a_server_sessions_first_sample_counts_from_zero(tmp_path: Path) -> None:
    """A session run holds one vLLM process's samples, whose counters began at 0 with it: a
    session scraped once (short, or scraped late on a busy host) is measured, its first requests
    included. A bench run's first sample stays its baseline; one sample there measures nothing.
    A window (`--split-at-flip`) starts from the sample before it."""
    from datetime import datetime, timedelta

    store = Store(tmp_path / "s.duckdb")
    t0 = datetime(2026, 11, 25, 1, 21)
    session, bench = "vllm-tiny-8000-20261125T012100Z", "run-20261125-bench"
    prompt = "vllm:prompt_tokens_total"
    rows = [(t0 + timedelta(seconds=30), "a", prompt, {}, session, 7986.0)]
    rows += [(t0 + timedelta(seconds=30), "a", prompt, {}, bench, 7986.0)]
    rows += [(t0 + timedelta(seconds=40 + i), "b", prompt, {}, "vllm-x", v)
             for i, v in enumerate([100.0, 150.0, 400.0])]  # fmt: skip
    store.add_metric_samples(rows)
    assert store.counter_deltas(session, [prompt]) == {prompt: 7986.0}
    assert store.counter_deltas(bench, [prompt]) == {prompt: None}
    since = (t0 + timedelta(seconds=41)).isoformat()
    params = {"run_id": "vllm-x", "names": [prompt], "since": since, "until": None}
    with store.read() as con:
        assert con.execute(sql.SLICE_COUNTER_DELTAS, params).fetchall() == [(prompt, 300.0, 2)]


def test_the_stores_connections_print_no_progress_bar(tmp_path: Path) -> None:
    """DuckDB prints its own progress bar to stdout once a query runs past 2 s, where `--json`
    output goes (seen in a migration of a 10 M-event store): every connection has it off."""
    store = Store(tmp_path / "s.duckdb")
    setting = "SELECT current_setting('enable_progress_bar')"
    with store.write() as con:
        assert con.execute(setting).fetchone() == (False,)
    with store.read() as con:
        assert con.execute(setting).fetchone() == (False,)


def test_a_store_a_newer_version_gave_more_columns_still_takes_rows_on_both_paths(
    tmp_path: Path,
) -> None:
    """A newer `servescope` (a report on the operator's laptop) may add columns to a store that
    an older sidecar keeps writing: every insert names its columns, so both ingest paths go on."""
    path = tmp_path / "s.duckdb"
    Store(path).add_events([{"request_id": "run-n-1"}])
    with duckdb.connect(str(path)) as con:
        con.execute("ALTER TABLE events ADD COLUMN from_the_future VARCHAR")
    store = Store(path)
    store.add_events([{"request_id": "run-n-2", "ttft_ms": 4}])
    with store.write() as con:
        chunk = b'{"request_id": "run-n-3", "ttft_ms": 5}\n'
        assert bulk.ingest_lines(store, con, chunk, source="f", offset=0).events == 1
    with store.read() as con:
        rows = con.execute("SELECT request_id, ttft_ms FROM events ORDER BY 1").fetchall()
    assert rows == [("run-n-1", None), ("run-n-2", 4.0), ("run-n-3", 5.0)]


def _span_piece(vllm_id: str, span: str, prompt: int, completion: int, ttft: float, e2e: float,
                queue: float) -> dict:  # fmt: skip
    """A trace piece as `collector.otlp.span_piece` builds it (figures of a real vLLM 0.32)."""
    return {
        "request_id": "run-20261125-parts-000001",
        "source": "vllm-trace",
        "server_ts": "2026-11-25T00:23:14.120000+00:00",
        "vllm_request_id": vllm_id,
        "vllm_part": f"{vllm_id}#{span}",
        "queue_ms": queue,
        "prefill_ms": 6.265,
        "decode_ms": round(e2e - ttft - 2.0, 3),
        "inference_ms": round(e2e - ttft + 4.0, 3),
        "server_ttft_ms": ttft,
        "server_e2e_ms": e2e,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "max_tokens": 8,
        "n": 1,
    }


# A completions call with two prompts and n=2, as vLLM 0.32 traced it: four child requests, the
# two samples of prompt 1 in lockstep (same timings, only the queue time differs). The API's
# usage said prompt_tokens 17 (6 + 11, each prompt once), completion_tokens 24.
PARTS = [
    _span_piece("cmpl-parts-0", "d46a83248ea8e777", 6, 6, 7.948, 26.353, 0.023),
    _span_piece("cmpl-parts-0", "f9983fac64eecfb5", 6, 6, 14.275, 32.486, 0.026),
    _span_piece("cmpl-parts-1", "7fc32c4376da7891", 11, 6, 14.275, 32.486, 0.019),
    _span_piece("cmpl-parts-1", "bc586fe83e132fb6", 11, 6, 14.275, 32.486, 0.007),
    {  # the log's `Received request` line of prompt 1: the request's n
        "request_id": "run-20261125-parts-000001",
        "source": "vllm-log",
        "log_ts": "2026-11-25T00:23:14",
        "vllm_request_id": "cmpl-parts-1",
        "n": 2,
        "max_tokens": 8,
    },
]


def test_parts_of_a_request_merge_to_the_apis_usage_in_any_order_and_idempotently(
    tmp_path: Path,
) -> None:
    """Child requests of one call (samples of n > 1, prompts of a list) are parts: their tokens
    add up as the API's usage counts them, whatever order their pieces come in, and a piece
    merged twice (an exporter's retry, a row merged again after a restart) changes nothing.
    Before, the last child's figures won: completion_tokens 6 where usage said 24."""
    orders = [list(p) for p in itertools.permutations(PARTS)]
    rows = []
    for order in orders:
        doc = order[0]
        for piece in [*order[1:], order[2], order[0]]:  # two pieces again
            doc = merge_docs(doc, piece)
        assert doc.pop("source") == order[0]["source"]  # the first seen, by design
        rows.append(doc)
    assert all(row == rows[0] for row in rows)
    row = {**rows[0], "source": "vllm-trace"}
    assert (row["prompt_tokens"], row["completion_tokens"], row["n"]) == (17, 24, 2)
    assert row["server_ttft_ms"] == 7.948 and row["server_e2e_ms"] == 32.486
    assert row["queue_ms"] == 0.007 and row["prefill_ms"] == 6.265
    assert row["vllm_request_id"] == "cmpl-parts-0"
    assert sorted(row["parts"]) == sorted(p["vllm_part"] for p in PARTS[:4])
    assert row["parts"]["cmpl-parts-1#bc586fe83e132fb6"]["completion_tokens"] == 6

    # in the store: one piece per flush (the stored row merged again each time), in two orders
    for name, order in (("a", PARTS), ("b", [*PARTS[3::-1], PARTS[4]])):
        store = Store(tmp_path / f"{name}.duckdb")
        for piece in [*order, order[1]]:
            store.add_events([dict(piece)])
        [doc] = store.export_events("run-20261125-parts")
        assert doc == row
        with store.read() as con:
            assert con.execute(
                "SELECT prompt_tokens, completion_tokens, ttft_ms, count(*) OVER () FROM events"
            ).fetchall() == [(17, 24, None, 1)]


def test_a_request_of_one_part_is_stored_flat_as_before(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    piece = PARTS[0]
    store.add_events([dict(piece), dict(PARTS[4]), dict(piece)])
    [doc] = store.export_events("run-20261125-parts")
    assert doc == {**PARTS[4], **piece}  # field by field, as always: no `parts`


def test_records_from_outside_named_like_parts_never_fail_a_merge(tmp_path: Path) -> None:
    """A line may hold `vllm_part` or `parts` with anything in them: merged as any record (the
    last value wins), never summed, never an error that would fail a flush."""
    rid = "run-20261125-odd-000001"
    odd_parts = {"parts": {"a#1": {"vllm_part": "a#1", "completion_tokens": "many"},
                           "a#2": {"vllm_part": "a#2", "server_ttft_ms": [1]}}}  # fmt: skip
    lines = [
        {"request_id": rid, **odd_parts},
        {"request_id": rid, **odd_parts, "note": 1},
        {"request_id": rid, "vllm_part": "x#1", "inference_ms": "slow"},
        {"request_id": rid, "vllm_part": "x#2", "server_ts": 5, "parts": [1]},
    ]
    store = Store(tmp_path / "s.duckdb")
    for line in lines:
        store.add_events([dict(line)])
    [doc] = store.export_events("run-20261125-odd")
    assert doc == {"request_id": rid, **lines[1], **lines[2], **lines[3]}


# -- the event's shape, defined three times, kept one -------------------------------------------
# The columns of `events` that are not a contract key: the record itself, and the failure's own
# words (any JSON value, kept as text, so not a typed key of the contract).
NOT_CONTRACT_COLUMNS = {"doc", "error_detail"}
# A key whose column holds what its value says in another type: the ISO text of a record's `ts`
# is a TIMESTAMP column.
PROJECTED = {"ts": (str, datetime)}


def _plain(kind: object) -> object:
    """A type with its `None` taken out and msgspec's constraints dropped: `str`, `int`, …"""
    if isinstance(kind, mi.Type):
        if isinstance(kind, mi.UnionType):
            (kind,) = [k for k in kind.types if not isinstance(k, mi.NoneType)]
        if isinstance(kind, mi.ListType):
            return list[_plain(kind.item_type)]  # type: ignore[misc]
        plain = {mi.StrType: str, mi.LiteralType: str, mi.IntType: int, mi.FloatType: float,
                 mi.BoolType: bool}  # fmt: skip
        return plain[type(kind)]
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        (kind,) = args
    if typing.get_origin(kind) is typing.Literal:
        return type(typing.get_args(kind)[0])
    if typing.get_origin(kind) in (typing.Required, typing.NotRequired):
        return _plain(typing.get_args(kind)[0])
    return kind


def _drift(contract: type[msgspec.Struct], record: type, table: type[SQLModel]) -> list[str]:
    """Where the three definitions of a request's keys differ: a key one of them lacks, or a
    key typed otherwise (as the record or the column holds it)."""
    info = mi.type_info(contract)
    assert isinstance(info, mi.StructType)
    keys = {f.name: _plain(f.type) for f in info.fields}
    typed = {k: _plain(v) for k, v in typing.get_type_hints(record).items()}
    columns = {
        name: _plain(field.annotation)
        for name, field in table.model_fields.items()
        if name not in NOT_CONTRACT_COLUMNS
    }
    out = [f"{k}: not in {record.__name__}" for k in keys.keys() - typed.keys()]
    out += [f"{k}: not in {contract.__name__}" for k in typed.keys() - keys.keys()]
    out += [f"{k}: no column" for k in keys.keys() - columns.keys()]
    out += [f"{k}: a column, not a key" for k in columns.keys() - keys.keys()]
    for key in keys.keys() & typed.keys() & columns.keys():
        in_record, in_column = PROJECTED.get(key, (keys[key], keys[key]))
        if (typed[key], columns[key]) != (in_record, in_column):
            out.append(f"{key}: {keys[key]} in the contract, {typed[key]} in the record, "
                       f"{columns[key]} in the column")  # fmt: skip
    return sorted(out)


def test_the_request_contract_the_typed_record_and_the_events_columns_are_one_shape() -> None:
    """`RequestEvent` (what a line must meet), `EventDoc` (the record as it leaves validation)
    and the SQLModel `Event` (the columns its keys are projected into) name the same keys with
    the same types: a key added to one and not the others, or typed otherwise, fails here."""
    assert _drift(RequestEvent, EventDoc, Event) == []
    assert EventDoc.__required_keys__ == {"request_id"}


def test_the_shapes_check_names_each_drift() -> None:
    """The check above fails on drift, naming it: a contract key the columns lack, a column
    the contract lacks, a key typed otherwise."""

    class Wider(RequestEvent, frozen=True, kw_only=True):
        new_ms: float | None = None

    class Table(SQLModel):
        request_id: str
        ttft_ms: int | None = None  # typed otherwise
        extra: str | None = None  # a column the contract lacks

    class Record(TypedDict, total=False):
        request_id: str
        ttft_ms: float | None
        new_ms: float | None

    found = _drift(Wider, Record, Table)
    assert "new_ms: no column" in found
    assert "extra: a column, not a key" in found
    assert any(f.startswith("ttft_ms: ") for f in found)
    assert "model: not in Record" in found


def test_the_kv_statement_has_one_shape_in_the_wire_and_in_the_notes() -> None:
    """vLLM's KV statement is typed twice, where it is read (`wire.kv_statement`) and where a
    session's notes keep it (`store.notes`: the store imports nothing of ours): the same keys
    of the same types."""
    from servescope.store import notes
    from servescope.wire import kv_statement

    read, kept = kv_statement.KvStatement, notes.KvStatement
    assert typing.get_type_hints(read) == typing.get_type_hints(kept)
    assert (read.__required_keys__, read.__optional_keys__) == (
        kept.__required_keys__,
        kept.__optional_keys__,
    )
