"""Container logs as Kubernetes (CRI) and Docker (json-file) keep them, unwrapped back into the
lines vLLM wrote: partial records joined per stream, the runtime's time and stream kept, plain
lines untouched.

`cri_records` and `docker_records` write lines the way the runtimes do (containerd splits a line
longer than `max_container_log_line_size` into `P` records closed by an `F`; Docker's json-file
driver splits at 16 KiB and marks the last piece by its newline); the collector's tests wrap a
real vLLM log with them."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from servescope.wire.container_log import Record, Unwrapper, dated, runtime_time
from servescope.wire.vllm_log import Access, Phase, parse_line
from tests.helpers.container_logs import cri_records, docker_records

T0 = datetime(2026, 11, 27, 0, 1, 2, 345678, tzinfo=UTC)
RECEIVED = "(APIServer pid=9) INFO 11-27 00:01:02 [logger.py:40] Received request cmpl-1: " + (
    "prompt: '" + "word " * 5000 + "', params: SamplingParams(n=1, max_tokens=16)"
)
ACCESS = 'INFO:     127.0.0.1:5000 - "POST /v1/completions HTTP/1.1" 400 Bad Request'
WARNING = "/usr/lib/python3.12/warnings.py:1: UserWarning: leaked semaphore"


def _unwrap(lines: list[str], max_bytes: int = 1024 * 1024) -> list[Record]:
    unwrap = Unwrapper(max_bytes)
    records = [unwrap.feed(line.encode()) for line in lines]
    assert not unwrap.pending
    return [r for r in records if r is not None]


@pytest.mark.parametrize("wrap", [cri_records, docker_records])
def test_split_lines_are_joined_and_each_keeps_its_time_and_stream(wrap) -> None:
    written = [
        (T0, "stdout", RECEIVED),
        (T0 + timedelta(seconds=1), "stderr", WARNING),
        (T0 + timedelta(seconds=2), "stdout", ACCESS),
    ]
    lines = wrap(written, max_record=1000)
    assert len(lines) > 25  # the request line came in many partial records
    records = _unwrap(lines)
    assert [r.text.decode() for r in records] == [text for _ts, _s, text in written]
    assert [r.stream for r in records] == ["stdout", "stderr", "stdout"]
    assert [r.ts for r in records] == [ts for ts, _s, _t in written]  # to the microsecond


@pytest.mark.parametrize("wrap", [cri_records, docker_records])
def test_partial_records_of_the_two_streams_interleave(wrap) -> None:
    out = wrap([(T0, "stdout", RECEIVED)], max_record=4000)
    err = wrap([(T0, "stderr", "E" * 9000)], max_record=4000)
    lines = [out[0], err[0], out[1], err[1], err[2], *out[2:]]
    records = _unwrap(lines)
    assert [(r.stream, r.text.decode()) for r in records] == [
        ("stderr", "E" * 9000),
        ("stdout", RECEIVED),
    ]


def test_plain_lines_and_vllms_own_json_lines_pass_unchanged() -> None:
    json_line = json.dumps({"asctime": "2026-11-27 00:01:02,345", "message": "hello"})
    lines = [RECEIVED, ACCESS, json_line, "2026 was a year", ""]
    assert _unwrap(lines) == [Record(line.encode()) for line in lines]


def test_the_runtimes_time_in_any_precision_and_zone_is_utc() -> None:
    assert runtime_time("2026-11-27T00:01:02Z") == datetime(2026, 11, 27, 0, 1, 2, tzinfo=UTC)
    assert runtime_time("2026-11-27T00:01:02.1Z") == datetime(
        2026, 11, 27, 0, 1, 2, 100000, tzinfo=UTC
    )
    assert runtime_time("2026-11-27T02:01:02.123456789+02:00") == datetime(
        2026, 11, 27, 0, 1, 2, 123456, tzinfo=UTC
    )
    assert runtime_time("yesterday") is None
    assert runtime_time("2026-11-27T00:01:02") is None  # no zone: not a runtime's time


def test_a_record_with_empty_text_is_an_empty_line() -> None:
    assert (
        _unwrap(["2026-11-27T00:01:02.5Z stdout F ", "2026-11-27T00:01:02.5Z stdout F"])
        == [Record(b"", runtime_time("2026-11-27T00:01:02.5Z"), "stdout")] * 2
    )


def test_a_joined_line_over_the_bound_is_kept_by_its_head_with_its_length() -> None:
    lines = cri_records([(T0, "stdout", "x" * 300_000)], max_record=16 * 1024)
    (record,) = _unwrap(lines, max_bytes=100_000)
    assert record.too_long == 300_000
    assert record.text == b"x" * 64 * 1024


def test_broken_docker_json_goes_to_the_log_parser_which_says_why() -> None:
    (record,) = _unwrap(['{"log":"half'])
    assert record == Record(b'{"log":"half')
    assert "invalid JSON" in parse_line(record.text, year=2026).reason  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "line",
    [
        '{"log":"x\\n","deep":' + "[" * 200_000 + "]" * 200_000 + "}",  # past any recursion limit
        '{"log":' + "[" * 200_000,
        '{"log":5,"stream":"stdout"}',
        "2026-13-45T99:99:99Z stdout F not a time",
        "2026-11-27T00:01:02Z stdout X not a CRI tag",
    ],
)
def test_a_hostile_record_is_a_plain_line_for_the_log_parser(line: str) -> None:
    assert _unwrap([line]) == [Record(line.encode())]


def test_a_split_line_waits_for_its_final_record() -> None:
    unwrap = Unwrapper(1024 * 1024)
    first, last = cri_records([(T0, "stdout", RECEIVED)], max_record=20_000)
    assert unwrap.feed(first.encode()) is None
    assert unwrap.pending
    record = unwrap.feed(last.encode())
    assert record is not None and record.text.decode() == RECEIVED
    assert not unwrap.pending


@pytest.mark.parametrize("wrap", [cri_records, docker_records])
def test_reading_resumed_between_a_lines_records_joins_it_whole(wrap) -> None:
    """A restarted collector reads on from its checkpoint, past partial records it had read:
    the bytes before that place give them back, and the line comes whole with its final
    record; a window that starts mid-line skips its cut first line."""
    lines = wrap([(T0, "stdout", ACCESS), (T0, "stdout", RECEIVED)], max_record=4000)
    data = "".join(line + "\n" for line in lines).encode()
    cut = data.index(lines[3].encode())  # three records read: the access line, two partials
    for size in (cut, cut - 10):  # the file from its start; a window cut inside the first line
        unwrap = Unwrapper(1024 * 1024)
        unwrap.resume(data[cut - size : cut], whole=size == cut)
        assert unwrap.pending
        records = [unwrap.feed(line) for line in data[cut:].split(b"\n")[:-1]]
        (record,) = [r for r in records if r is not None]
        assert record.text.decode() == RECEIVED and record.ts == T0


def test_an_undated_line_takes_the_runtimes_time_to_the_second() -> None:
    access = parse_line(ACCESS.encode(), year=2026)
    assert isinstance(access, Access) and access.ts is None
    assert dated(access, T0) == Access("POST", "/v1/completions", 400, T0.replace(microsecond=0))
    ready = parse_line(b"INFO:     Application startup complete.", year=2026)
    assert isinstance(ready, Phase)
    assert dated(ready, T0).ts == T0.replace(microsecond=0)
    # a line vLLM dated keeps vLLM's time; lines that say nothing stay nothing
    received = parse_line(RECEIVED.encode(), year=2026)
    assert dated(received, T0) == received
    line = b"(APIServer pid=9) INFO 11-27 00:01:00 [api_server.py:1] Engine 000: Avg prompt throughput: 1.0 tokens/s"  # noqa: E501
    stats = parse_line(line, year=2026)
    assert dated(stats, T0).ts == stats.ts != T0  # type: ignore[union-attr]
    assert dated(None, T0) is None
