"""Property tests (hypothesis) of hostile input on every entry point (issue 15): deep nesting,
huge strings, non-finite numbers, invalid UTF-8, wrong types, lenient JSON DuckDB would read,
repeated keys and path-like run ids. Whatever the lines:
- nothing raises but `InvalidEvent` (which is the quarantine reason);
- good + quarantined = non-blank lines, for `store import` and for the collector alike, and both
  store the same rows (one rule set);
- nothing non-finite or negative is stored where reports compute;
- every file written (reports, Parquet, jsonl exports) is under the folder it was asked for."""

from __future__ import annotations

import json
import math
import tempfile
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servescope.collector import Collector
from servescope.collector.sources.events import EventsFiles
from servescope.collector.sources.logs import VllmLog
from servescope.collector.sources.otlp import OtlpTraces
from servescope.reports import ReportOptions, build_summary, write_report
from servescope.store import InvalidEvent, Store, export_run, import_file, parse_line
from servescope.store.parquet import export_parquet
from servescope.store.validation import CONTRACT_TYPES, DURATIONS, load_event
from servescope.wire.vllm_log import parse_line as parse_log_line

TYPED = "SELECT * EXCLUDE (doc) FROM events ORDER BY run_id, request_id"
RUN_IDS = st.sampled_from(
    ["run-a", "../../escape", "a/b", "/abs", "x\x00y", "r" * 300, "😀", ".", "..", "%2F", "C:\\x"]
) | st.text(min_size=1, max_size=12)
HOSTILE_NUMBERS = st.sampled_from([math.nan, math.inf, -math.inf, -5, -0.0, 1e308, 2**31, 2**70])
numbers = st.one_of(st.integers(0, 10_000), st.floats(0, 1e6), HOSTILE_NUMBERS)
values = st.recursive(
    st.none() | st.booleans() | numbers | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=5,
)
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "run_id": RUN_IDS,
    "ts": st.sampled_from(["2026-11-22T04:29:59Z", "not a time", ""]),
    "model": st.text(max_size=8) | st.integers(),
    "prompt_tokens": st.integers(-5, 2**32) | HOSTILE_NUMBERS | st.text(max_size=3),
    "completion_tokens": st.integers(0, 1000),
    "cache_hit": st.booleans() | st.integers(0, 1),
    "ttft_ms": numbers | st.text(max_size=3),
    "tpot_ms": numbers,
    "itl_ms": st.lists(numbers, max_size=4) | st.lists(st.text(max_size=2), max_size=2),
    "http_status": st.integers(0, 1200),
    "status": st.sampled_from(["ok", "error", "weird"]),
}
BIG = b'"' + b"x" * (1 << 19) + b'"'  # half a MiB: a huge string that still fits a line


@st.composite
def a_doc(draw: st.DrawFn, index: int) -> dict[str, Any]:
    doc: dict[str, Any] = {"request_id": f"{draw(st.sampled_from(['q', 'run-x', '']))}-{index:06d}"}
    for key in draw(st.lists(st.sampled_from(sorted(FIELDS)), unique=True, max_size=6)):
        doc[key] = draw(FIELDS[key])
    if draw(st.booleans()):
        doc[draw(st.text(min_size=1, max_size=4))] = draw(values)
    return doc


@st.composite
def a_line(draw: st.DrawFn, index: int) -> bytes:
    text = json.dumps(draw(a_doc(index))).encode()  # NaN and Infinity come out as such
    shape = draw(
        st.sampled_from(
            ["plain", "plain", "plain", "deep", "huge", "utf8", "bom", "crlf", "comma", "nan",
             "dup", "truncated", "garbage", "array", "lenient"]
        )
    )  # fmt: skip
    if shape == "deep":
        depth = draw(st.sampled_from([63, 64, 65, 1000, 100_000]))
        return text[:-1] + b', "deep": ' + b"[" * depth + b"]" * depth + b"}"
    if shape == "huge":
        return text[:-1] + b', "huge": ' + BIG + b"}"
    if shape == "utf8":
        at = draw(st.integers(0, len(text) - 1))
        return text[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80"])) + text[at:]
    if shape == "bom":
        return b"\xef\xbb\xbf" + text
    if shape == "crlf":
        return text + b"\r"
    if shape == "comma":
        return text[:-1] + b",}"
    if shape == "nan":
        return (
            text[:-1] + b', "n": ' + draw(st.sampled_from([b"NaN", b"-Infinity", b"1e999"])) + b"}"
        )
    if shape == "dup":
        return b'{"ttft_ms": ' + draw(st.sampled_from([b"1", b'"x"', b"-1"])) + b", " + text[1:]
    if shape == "truncated":
        return text[: draw(st.integers(1, max(1, len(text) - 1)))]
    if shape == "garbage":
        return draw(st.binary(min_size=1, max_size=40)).replace(b"\n", b" ")
    if shape == "array":
        return b"[" + text + b"]"
    return text[:-1] + b', "l": ' + draw(st.sampled_from([b"nan", b"-INF", b"[1,]", b"inf"])) + b"}"


@st.composite
def a_file(draw: st.DrawFn) -> list[bytes]:
    n = draw(st.integers(1, 25))
    lines = [draw(a_line(i)) for i in range(n)]
    for i in draw(st.lists(st.integers(0, n - 1), max_size=3)):  # a request on several lines
        lines.append(lines[i])
    return lines


def _verdicts(lines: list[bytes]) -> tuple[int, int]:
    good = bad = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            parse_line(line)
            good += 1
        except InvalidEvent:
            bad += 1
    return good, bad


def _assert_finite(store: Store) -> None:
    """Nothing a report computes from is NaN, infinite or negative; docs read back under the
    rules, their contract numbers finite."""
    with store.read() as con:
        rows = con.execute("SELECT * EXCLUDE (doc), doc FROM events").fetchall()
    for row in rows:
        for value in row[:-1]:
            for v in value if isinstance(value, list) else [value]:
                if isinstance(v, float):
                    assert math.isfinite(v) and v >= 0, row
        doc = load_event(row[-1])
        for key in CONTRACT_TYPES:
            if isinstance(doc.get(key), float):
                assert math.isfinite(doc[key])
        for key in DURATIONS:
            if doc.get(key) is not None:
                assert doc[key] >= 0


def _under(folder: Path, paths: list[Path]) -> None:
    root = folder.resolve()
    for path in paths:
        assert root in path.resolve().parents, path


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(a_file())
def test_import_and_collector_agree_and_lose_nothing(lines: list[bytes]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path = folder / "f.events.jsonl"
        path.write_bytes(b"\n".join(lines) + b"\n")
        good, bad = _verdicts(lines)
        imported = Store(folder / "i.duckdb")
        result = import_file(imported, path)
        assert (result.events + result.runtime_events, result.errors) == (good, bad)
        collected = Store(folder / "c.duckdb")
        collector = Collector(collected, [EventsFiles(str(path))], once=True)
        collector.run_once()
        assert collector.totals["errors"] == bad
        with imported.read() as a, collected.read() as b:
            assert str(a.execute(TYPED).fetchall()) == str(b.execute(TYPED).fetchall())
            assert a.execute("SELECT count(*) FROM ingest_errors").fetchone() == (bad,)
            assert b.execute("SELECT count(*) FROM ingest_errors").fetchone() == (bad,)
            runs = [r for (r,) in a.execute("SELECT DISTINCT run_id FROM events").fetchall()]
        _assert_finite(imported)
        _assert_finite(collected)
        out = folder / "out"
        written: list[Path] = []
        for run_id in runs[:3]:
            report = build_summary(imported, run_id, ReportOptions(charts=False))
            written += write_report(report, out, ("json",))
            jsonl = out / "jsonl" / "x.events.jsonl"
            export_run(imported, run_id, jsonl)
            written.append(jsonl)
        export_parquet(imported, out / "pq")
        written += list((out / "pq").rglob("*"))
        _under(out, written)
        assert {p.resolve() for p in folder.rglob("*") if p.is_file()} <= {
            path.resolve(),
            *(p.resolve() for p in folder.glob("*.duckdb*")),
            *(p.resolve() for p in written),
        }


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.builds(lambda _i, line: line, st.integers(), a_line(1)))
def test_parse_line_only_ever_raises_invalid_event(line: bytes) -> None:
    try:
        doc = parse_line(line)
    except InvalidEvent as exc:
        assert str(exc)
    else:
        assert isinstance(doc, dict)


LOG_PREFIX = "(APIServer pid=7) INFO 11-22 04:29:59 [logger.py:1] "


@st.composite
def a_log_line(draw: st.DrawFn) -> bytes:
    message = draw(
        st.sampled_from(
            ["Received request cmpl-{}-0: params: SamplingParams(max_tokens={})",
             "Added request {}.", "Request {} failed: {}", "Engine 000: Avg prompt throughput: {}",
             "non-default args: {{'x': {}}}"]
        )
    ).format(draw(st.text(max_size=20)), draw(st.text(max_size=20)))  # fmt: skip
    if draw(st.booleans()):
        line = json.dumps({"asctime": "2026-11-22 04:29:59,123", "message": message}).encode()
    else:
        line = (LOG_PREFIX + message).encode("utf-8", "surrogatepass")
    return draw(st.sampled_from([line, line, b"[" * 5000, line + b"\xff", b'{"message": NaN}']))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(a_log_line(), min_size=1, max_size=15))
def test_log_lines_never_stop_the_collector(lines: list[bytes]) -> None:
    for line in lines:
        parse_log_line(line, year=2026)  # never raises
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "vllm.log"
        log.write_bytes(b"\n".join(lines) + b"\n")
        store = Store(Path(tmp) / "s.duckdb")
        Collector(store, [VllmLog(str(log))], once=True).run_once()
        _assert_finite(store)


span_values = st.one_of(
    st.fixed_dictionaries({"doubleValue": st.floats(allow_nan=True) | st.text(max_size=3)}),
    st.fixed_dictionaries({"intValue": st.integers(-(2**70), 2**70).map(str)}),
    st.fixed_dictionaries({"stringValue": st.text(max_size=8)}),
)


@st.composite
def an_otlp_body(draw: st.DrawFn) -> bytes:
    attrs = [
        {"key": "gen_ai.request.id", "value": {"stringValue": draw(st.text(max_size=10))}},
        *(
            {"key": key, "value": draw(span_values)}
            for key in draw(
                st.lists(
                    st.sampled_from(
                        ["gen_ai.latency.time_to_first_token", "gen_ai.latency.e2e",
                         "gen_ai.usage.prompt_tokens", "gen_ai.request.temperature"]
                    ),
                    unique=True,
                )
            )
        ),
    ]  # fmt: skip
    span = {
        "name": "llm_request",
        "traceId": draw(st.text(max_size=4)),
        "startTimeUnixNano": draw(st.sampled_from(["0", "1795554724000000000", str(2**80), "x"])),
        "attributes": attrs,
    }
    body = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}).encode()
    return draw(st.sampled_from([body, body, b"[" * 100_000, body[:-3], b"\xff" + body]))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(an_otlp_body(), min_size=1, max_size=4))
def test_otlp_bodies_are_answered_and_never_stored_non_finite(bodies: list[bytes]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "s.duckdb")
        receiver = OtlpTraces(port=0)
        collector = Collector(store, [receiver], flush_interval=0.02)
        collector.start()
        stop = threading.Event()
        loop = threading.Thread(target=collector.run, args=(stop,), daemon=True)
        loop.start()
        try:
            for body in bodies:
                request = urllib.request.Request(
                    f"http://127.0.0.1:{receiver.port}/v1/traces",
                    data=body,
                    headers={"Content-Type": "application/json"},
                )
                try:
                    with urllib.request.urlopen(request, timeout=60) as response:
                        assert response.status == 200
                except urllib.error.HTTPError as exc:
                    assert exc.code == 400
        finally:
            stop.set()
            loop.join(timeout=60)  # the receiver stops with the collector
        assert not loop.is_alive()
        _assert_finite(store)
