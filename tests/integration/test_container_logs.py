"""The collector reads vLLM's output as a container runtime keeps it, without being told: the
same real vLLM log (tests/fixtures/gpu/vllm-h100.log: two server lifetimes, a lever flip, 40
requests, 6 refusals), plain, CRI-wrapped with partial records and Docker-json-wrapped, gives
the same runs, requests and refusals in the store; a pod log rotated by the kubelet between
two reads is read as a rotated plain log is."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from servescope.store.settings import free_port
from tests.helpers.cli import ROOT, SERVESCOPE
from tests.helpers.container_logs import (
    MAX_RECORD,
    Written,
    collect_log,
    cri_records,
    docker_records,
    store_contents,
    write_log,
    written,
)
from tests.helpers.lines import GPU_LOG


@pytest.fixture(scope="module")
def vllm_output() -> list[Written]:
    with GPU_LOG.open(newline="") as log:  # its progress bars' carriage returns kept
        return written(log.read(), datetime.now(UTC).year)


@pytest.fixture(scope="module")
def plain(vllm_output: list[Written], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("plain")
    log = write_log(folder / "vllm.log", [t for _ts, _s, t in vllm_output], vllm_output[-1][0])
    collect_log(folder / "s.duckdb", log)
    contents = store_contents(folder / "s.duckdb")
    assert len(contents["runs"]) == 2 and len(contents["requests"]) == 40
    assert len(contents["refusals"]) == 6 and contents["flips"] and contents["errors"] == (0,)
    return contents


@pytest.mark.parametrize("wrap", [cri_records, docker_records], ids=["cri", "docker-json"])
def test_a_wrapped_log_gives_what_the_plain_log_gives(
    wrap: Any, vllm_output: list[Written], plain: dict[str, Any], tmp_path: Path
) -> None:
    lines = wrap(vllm_output, max_record=MAX_RECORD)
    assert len(lines) - len(vllm_output) > 80  # the long lines (requests' among them) came split
    log = write_log(tmp_path / "pods" / "default_vllm-0_uid" / "vllm" / "0.log", lines,
                 vllm_output[-1][0])  # fmt: skip
    collect_log(tmp_path / "s.duckdb", log)
    assert store_contents(tmp_path / "s.duckdb") == plain


def test_a_pod_log_rotated_by_the_kubelet_is_read_across_the_rotation(
    vllm_output: list[Written], plain: dict[str, Any], tmp_path: Path
) -> None:
    """The kubelet renames `0.log` to `0.log.<time>` and the runtime opens a new `0.log`; the
    collector, restarted in between, finishes the renamed file and reads the new one."""
    lines = cri_records(vllm_output, max_record=MAX_RECORD)
    cut = next(i for i in range(len(lines) // 2, len(lines)) if " F " in lines[i][:45]) + 1
    log = tmp_path / "pods" / "default_vllm-0_uid" / "vllm" / "0.log"
    store = tmp_path / "s.duckdb"
    middle = vllm_output[len(vllm_output) // 2][0]
    write_log(log, lines[:cut], middle)
    collect_log(store, log)
    log.rename(log.with_name("0.log.20261125-123800"))
    write_log(log, lines[cut:], vllm_output[-1][0])
    collect_log(store, log)
    assert store_contents(store) == plain


def test_a_collector_restarted_between_a_lines_records_reads_it_whole(
    vllm_output: list[Written], plain: dict[str, Any], tmp_path: Path
) -> None:
    """The first run reads up to a line's partial records and checkpoints past them; the
    next, started once the final record is there, reads the line whole."""
    lines = cri_records(vllm_output, max_record=MAX_RECORD)
    split = [i for i, line in enumerate(lines) if " P " in line[:45] and "Received request" in line]
    cut = split[len(split) // 2] + 1  # a request's line, its first record read, the rest not
    log, store = tmp_path / "0.log", tmp_path / "s.duckdb"
    write_log(log, lines[:cut], vllm_output[0][0])
    collect_log(store, log)
    with log.open("ab") as f:
        f.write("".join(line + "\n" for line in lines[cut:]).encode())
    collect_log(store, log)
    assert store_contents(store) == plain


def _lines_read(port: int) -> float:
    """The collector's `servescope_collector_lines_total` for the log (0 before it answers)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return 0.0
    found = re.search(r'^servescope_collector_lines_total\{source="vllm-log:[^"]*"\} (\S+)$',
                      text, re.M)  # fmt: skip
    return float(found[1]) if found else 0.0


def _wait_for(port: int, lines: int, process: subprocess.Popen[bytes], out: Path) -> None:
    deadline = time.monotonic() + 120
    while _lines_read(port) < lines:
        assert process.poll() is None, out.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, f"read {_lines_read(port)} of {lines} lines"
        time.sleep(0.1)


def test_a_line_split_across_two_writes_is_joined_by_a_running_collector(
    vllm_output: list[Written], plain: dict[str, Any], tmp_path: Path
) -> None:
    """The runtime flushes a long line's first partial records before its last one: a running
    collector reads the first part in one poll and the rest in a later one, and stores the
    line whole; the store then holds what the plain log gives."""
    lines = cri_records(vllm_output, max_record=MAX_RECORD)
    received = next(i for i, line in enumerate(lines) if " P " in line[:45]
                    and "Received request" in line)  # fmt: skip
    log = write_log(tmp_path / "0.log", lines[: received + 1], vllm_output[0][0])
    store, port, out = tmp_path / "s.duckdb", free_port(), tmp_path / "collect.out"
    process = subprocess.Popen(
        [*SERVESCOPE, "collect", "--vllm-log", str(log), "--store", str(store),
         "--metrics-port", str(port)],
        cwd=ROOT, stdout=out.open("wb"), stderr=subprocess.STDOUT, env={**os.environ, "TZ": "UTC"},
    )  # fmt: skip
    try:
        _wait_for(port, sum(" F " in line[:45] for line in lines[: received + 1]), process, out)
        with log.open("ab") as f:  # the rest, the line's final record first
            f.write("".join(line + "\n" for line in lines[received + 1 :]).encode())
        _wait_for(port, sum(" F " in line[:45] for line in lines), process, out)
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, out.read_text(errors="replace")[-3000:]
    assert store_contents(store) == plain
