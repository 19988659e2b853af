"""Fuzzing the collector's line parsers (hypothesis): they never raise, every valid line is
ingested, and every invalid one is in `ingest_errors` at its offset. `store.validation.parse_line`
is the definition of a valid `.events.jsonl` line; the collector's fast path must agree."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servescope.collector import Collector
from servescope.collector.sources.events import EventsFiles
from servescope.store import InvalidEvent, Store, merge_docs, run_id_of
from servescope.store import parse_line as parse_event
from servescope.wire.vllm_log import Piece, parse_line

TYPED_COLUMNS = "SELECT * EXCLUDE (doc) FROM events ORDER BY run_id, request_id"
TEXT_PREFIX = "(APIServer pid=7) INFO 11-22 04:29:59 [request_logger.py:65] "
ids = st.from_regex(r"[A-Za-z0-9_.:-]{1,40}", fullmatch=True)
numbers = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True))
values = st.recursive(
    st.none() | st.booleans() | numbers | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)
CONTRACT = {
    "run_id": st.text(max_size=15),
    "ts": st.sampled_from(["2026-11-22T04:29:59Z", "not a time", "2026-11-22 04:29:59.123"]),
    "model": st.text(max_size=10),
    "source": st.sampled_from(["client", "gateway", "import"]),
    "prompt_tokens": st.integers(-5, 2**40),
    "completion_tokens": st.integers(0, 10_000),
    "cached_tokens": st.integers(0, 10_000),
    "cache_hit": st.booleans(),
    "ttft_ms": numbers,
    "tpot_ms": numbers,
    "e2e_ms": st.floats(0, 1e6),
    "itl_ms": st.lists(st.floats(0, 1e4) | st.integers(0, 100), max_size=5),
    "queue_ms": numbers,
    "finish_reason": st.sampled_from(["stop", "length", "error"]),
    "status": st.sampled_from(["ok", "error", "timeout", "rejected", "weird"]),
    "http_status": st.integers(100, 599),
    "error": st.text(max_size=10),
}


@st.composite
def valid_doc(draw: st.DrawFn, index: int) -> dict[str, Any]:
    doc: dict[str, Any] = {"request_id": f"{draw(ids)}-{index:06d}"}
    for key in draw(st.lists(st.sampled_from(sorted(CONTRACT)), unique=True, max_size=8)):
        doc[key] = draw(CONTRACT[key])
    for key in draw(st.lists(st.text(min_size=1, max_size=8), unique=True, max_size=3)):
        if key not in CONTRACT and key not in ("request_id", "type"):
            doc[key] = draw(values)
    return doc


@st.composite
def a_line(draw: st.DrawFn, index: int) -> bytes:
    doc = draw(valid_doc(index))
    kind = draw(st.sampled_from(["valid", "valid", "truncated", "garbage", "wrong", "array"]))
    text = json.dumps(doc).encode()
    if kind == "truncated":
        return text[: draw(st.integers(1, max(1, len(text) - 1)))]
    if kind == "garbage":
        return draw(st.binary(min_size=1, max_size=60)).replace(b"\n", b" ")
    if kind == "wrong":
        key = draw(st.sampled_from(["prompt_tokens", "cache_hit", "ttft_ms", "itl_ms", "status"]))
        doc[key] = draw(st.sampled_from(["x", [1, "a"], {"a": 1}, True, 1.5]))
        return json.dumps(doc).encode()
    if kind == "array":
        return json.dumps([doc]).encode()
    return text


@st.composite
def files(draw: st.DrawFn) -> list[bytes]:
    n = draw(st.integers(1, 40))
    lines = [draw(a_line(i)) for i in range(n)]
    # requests on several lines: a line again, or the same request with other fields
    for i in draw(st.lists(st.integers(0, n - 1), max_size=4)):
        lines.append(lines[i] if draw(st.booleans()) else draw(a_line(i)))
    return lines


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=3000))
def test_log_parser_never_raises_on_bytes(raw: bytes) -> None:
    parse_line(raw, year=2026)


log_messages = st.one_of(
    st.builds(
        lambda i, rest: f"Received request {i}: {rest}", st.text(max_size=30), st.text(max_size=30)
    ),
    st.builds(lambda i: f"Added request {i}.", st.text(max_size=30)),
    st.builds(lambda i, r: f"Request {i} failed{r}", st.text(max_size=20), st.text(max_size=20)),
    st.builds(lambda b: f"Engine 000: Avg prompt throughput: {b}", st.text(max_size=60)),
    st.builds(lambda b: f"non-default args: {{{b}}}", st.text(max_size=60)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(log_messages, st.booleans())
def test_log_parser_never_raises_on_messages(message: str, as_json: bool) -> None:
    line = (
        json.dumps({"asctime": "2026-11-22 04:29:59,123", "message": message})
        if as_json
        else (TEXT_PREFIX + message)
    )
    parse_line(line.encode("utf-8", errors="surrogatepass"), year=2026)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["cmpl-{}-0", "chatcmpl-{}"]), ids, st.booleans())
def test_every_received_line_gives_its_client_id(form: str, rid: str, as_json: bool) -> None:
    rid = f"{rid}-000001"
    message = f"Received request {form.format(rid)}: params: SamplingParams(max_tokens=3)"
    line = (
        json.dumps({"asctime": "2026-11-22 04:29:59,123", "message": message})
        if as_json
        else (TEXT_PREFIX + message)
    )
    item = parse_line(line.encode(), year=2026)
    assert isinstance(item, Piece) and item.doc["request_id"] == rid


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(files())
def test_events_lines_valid_ingested_invalid_quarantined(lines: list[bytes]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "f.events.jsonl"
        path.write_bytes(b"\n".join(lines) + b"\n")
        expected: dict[tuple[str, str], dict[str, Any]] = {}
        valid = []
        bad_offsets = set()
        offset = 0
        for line in lines:
            if line.strip():
                try:
                    doc = parse_event(line)
                    key = (run_id_of(doc), doc["request_id"])
                    expected[key] = merge_docs(expected[key], doc) if key in expected else doc
                    valid.append(doc)
                except InvalidEvent:
                    bad_offsets.add(offset)
            offset += len(line) + 1
        store = Store(Path(folder) / "s.duckdb")
        Collector(store, [EventsFiles(str(path))], once=True).run_once()
        ordinary = Store(Path(folder) / "o.duckdb")  # every line through the ordinary path
        ordinary.add_events(valid)
        with store.read() as con:
            rows = con.execute("SELECT run_id, request_id, doc FROM events").fetchall()
            errors = {r[0] for r in con.execute('SELECT "offset" FROM ingest_errors').fetchall()}
            columns = con.execute(TYPED_COLUMNS).fetchall()
        stored = {(r, q): json.loads(d) for r, q, d in rows}
        assert set(stored) == set(expected)
        for key, doc in expected.items():
            assert json.dumps(stored[key], sort_keys=True) == json.dumps(doc, sort_keys=True)
        assert errors == bad_offsets
        with ordinary.read() as con:  # the typed columns too, NaN included (compared as text)
            assert str(columns) == str(con.execute(TYPED_COLUMNS).fetchall())
