"""The collector's parts on real files, a real DuckDB store, the real OTel SDK exporter and the
CLI as a user runs it (the end-to-end test with vLLM is tests/e2e/test_collector_e2e.py)."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import duckdb
from pythonjsonlogger.jsonlogger import JsonFormatter  # the class vLLM's JSON logging uses

from servescope.wire.vllm_log import Access, Bad, Piece, parse_line
from tests.helpers.cli import servescope
from tests.helpers.lines import ACCESS, ADDED, LEVERS, RECEIVED


def _store_rows(path: Path, sql: str) -> list[tuple]:
    con = duckdb.connect(str(path), read_only=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def test_bad_input_is_quarantined_and_nothing_valid_is_lost(tmp_path: Path) -> None:
    good = [{"request_id": f"run-20261122-bad-{i:03d}", "ttft_ms": i, "extra": {"k": i}}
            for i in range(20)]  # fmt: skip
    bad = [
        b'{"request_id": "run-20261122-bad-900", "ttft_ms": 1',  # truncated JSON
        b"\x00\x01\x02\xff binary garbage \xfe",
        b'{"request_id": "run-20261122-bad-901", "pad": "' + b"x" * (10 * 1024 * 1024) + b'"}',
        b'{"request_id": "run-20261122-bad-902", "prompt_tokens": "many"}',  # wrong type
        b'["not", "an", "object"]',
    ]
    lines = [json.dumps(d).encode() for d in good]
    for i, line in enumerate(bad):
        lines.insert(3 + 4 * i, line)
    events = tmp_path / "a.events.jsonl"
    events.write_bytes(b"\n".join(lines) + b"\n")
    offsets = {}
    offset = 0
    for line in lines:
        offsets[line] = offset
        offset += len(line) + 1
    log = tmp_path / "vllm.log"
    log.write_text(RECEIVED + "\n" + ADDED + "\n" + ACCESS + "\n")
    store = tmp_path / "s.duckdb"
    result = servescope(
        "collect", "--once", "--events", str(tmp_path / "*.events.jsonl"), "--vllm-log", str(log),
        "--store", str(store), "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    totals = json.loads(result.stdout)
    assert totals["errors"] == len(bad)
    stored = dict(_store_rows(store, "SELECT request_id, doc FROM events"))
    for doc in good:  # unknown fields kept verbatim
        assert json.loads(stored[doc["request_id"]]) == doc
    assert "h3probe-000001" in stored  # the log source went on
    responses = _store_rows(
        store, "SELECT labels, value FROM metric_samples WHERE name = 'vllm_log:http_responses'"
    )
    assert [(json.loads(labels)["status"], value) for labels, value in responses] == [("200", 1.0)]
    errors = _store_rows(store, 'SELECT "offset", reason, length(raw) FROM ingest_errors')
    assert sorted(o for o, _r, _n in errors) == sorted(offsets[b] for b in bad)
    reasons = " | ".join(r for _o, r, _n in errors)
    for word in ("invalid JSON", "line too long", "wrong type for prompt_tokens", "not a JSON"):
        assert word in reasons
    assert max(n for _o, _r, n in errors) < 100_000  # a 10 MB line is kept as its head


def test_once_needs_existing_files(tmp_path: Path) -> None:
    result = servescope("collect", "--once", "--vllm-log", str(tmp_path / "missing.log"))
    assert result.returncode == 2 and "no such log file" in result.stderr
    assert servescope("collect").returncode == 2


def test_server_restart_with_other_levers_is_a_lever_flip(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    second = LEVERS.replace("'enable_log_requests': True}", "'enable_log_requests': True, "
                            "'enable_prefix_caching': False}")  # fmt: skip
    log.write_text("\n".join([LEVERS, RECEIVED, second, ADDED]) + "\n")
    store = tmp_path / "s.duckdb"
    assert (
        servescope("collect", "--once", "--vllm-log", str(log), "--store", str(store)).returncode
        == 0
    )
    flips = _store_rows(store, "SELECT lever, before, after FROM lever_flips")
    assert flips == [("enable_prefix_caching", None, "false")]
    # ingesting again (a restart with its checkpoint) adds nothing
    assert (
        servescope("collect", "--once", "--vllm-log", str(log), "--store", str(store)).returncode
        == 0
    )
    assert len(_store_rows(store, "SELECT * FROM lever_flips")) == 1
    assert len(_store_rows(store, "SELECT * FROM events")) == 1


def vllm_json_line(message: str, *args: object, name: str = "vllm.entrypoints") -> str:
    """A line exactly as vLLM's JSON formatter writes it (its own format string and class)."""
    from vllm.logging_utils.formatter import JSON_FORMAT

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter(JSON_FORMAT))
    logger = logging.getLogger(f"servescope-test-{name}")
    logger.handlers = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    record = logger.makeRecord(name, logging.INFO, __file__, 1, message, args, None)
    logger.handle(record)
    return stream.getvalue().strip()


def test_json_lines() -> None:
    received = parse_line(
        vllm_json_line(
            "Received request %s: params: %s", "chatcmpl-j-000001", "max_tokens=7"
        ).encode(),
        year=2000,
    )
    assert isinstance(received, Piece) and received.doc["request_id"] == "j-000001"
    assert received.doc["max_tokens"] == 7 and received.doc["log_ts"].startswith("20")
    access = vllm_json_line(
        '%s - "%s %s HTTP/%s" %d', "127.0.0.1:1", "POST", "/v1/chat/completions", "1.1", 503,
        name="uvicorn.access",
    )  # fmt: skip
    parsed = parse_line(access.encode(), year=2000)
    assert isinstance(parsed, Access) and parsed.ts is not None  # JSON access lines are timed
    assert (parsed.method, parsed.path, parsed.status) == ("POST", "/v1/chat/completions", 503)
    assert isinstance(parse_line(b'{"asctime": "2026-11-22 04', year=2026), Bad)
    assert isinstance(parse_line(b"\xff\xfe\x00garbage", year=2026), Bad)
