"""A full disk — the lake's or the store's — never loses a row: the collector keeps its batch and
its checkpoints, says so once in its log and on its `/metrics`, keeps tailing, and catches up
when space returns. The disk is a real, small tmpfs filled by a real file (root mounts it, as
it is in CI and on the development machine)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from servescope.store import Store
from servescope.store.lakeread import Lake
from servescope.store.settings import free_port
from tests.helpers.cli import ROOT, SERVESCOPE
from tests.helpers.lake import collector_metrics, wait_collector_up

RUN = "run-20261125-diskfull"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    disk = tmp_path / "disk"
    disk.mkdir()
    root = [] if os.geteuid() == 0 else ["sudo", "-n"]  # as the Makefile installs packages
    options = "size=24m,mode=1777"
    subprocess.run([*root, "mount", "-t", "tmpfs", "-o", options, "tmpfs", str(disk)], check=True)
    try:
        yield disk
    finally:
        subprocess.run([*root, "umount", "-l", str(disk)], check=False)


def _lines(first: int, n: int) -> bytes:
    out = []
    for i in range(first, first + n):
        doc = {"request_id": f"{RUN}-{i:06d}", "ts": "2026-11-25T10:00:00Z", "ttft_ms": i % 97,
               "status": "ok", "model": "tiny", "note": "x" * 200}  # fmt: skip
        out.append(json.dumps(doc) + "\n")
    return "".join(out).encode()


def _fill(disk: Path) -> Path:
    """A file that takes every byte the disk has left (again, when called again)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def _gauge(port: int, name: str) -> float | None:
    found = re.search(rf"^{name} (\S+)$", collector_metrics(port), re.M)
    return float(found[1]) if found else None


def _failures(port: int) -> float:
    """The collector's failed flushes for a full disk so far."""
    name = re.escape('servescope_collector_flush_failures_total{reason="disk_full"}')
    found = re.search(rf"^{name} (\S+)$", collector_metrics(port), re.M)
    return float(found[1]) if found else 0.0


def _until(check, what: str, timeout: float = 180.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("full", ["lake", "store"])
def test_a_full_disk_loses_nothing_and_catches_up(
    tmp_path: Path, small_disk: Path, full: str
) -> None:
    events = tmp_path / "node.events.jsonl"
    events.touch()
    store = (small_disk if full == "store" else tmp_path) / "node.duckdb"
    lake = (small_disk if full == "lake" else tmp_path) / "lake"
    out = tmp_path / "collector.out"
    port = free_port()
    written = 6  # batches of 2,000 lines written: five before the failure, one at first
    proc = subprocess.Popen(
        [*SERVESCOPE, "collect", "--events", str(events), "--store", str(store), "--lake",
         str(lake), "--metrics-port", str(port)],
        cwd=ROOT, stdout=out.open("ab"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_collector_up(proc, port, out)
        with events.open("ab") as fh:
            fh.write(_lines(0, 2000))
        _until(lambda: (_gauge(port, "servescope_collector_events_written_total") or 0) >= 2000,
               "the first rows")  # fmt: skip
        filler = _fill(small_disk)
        with events.open("ab") as fh:  # read while the disk is full: kept, not lost
            for k in range(1, 6):
                fh.write(_lines(2000 * k, 2000))
                fh.flush()
                time.sleep(0.3)
        _until(lambda: _gauge(port, "servescope_collector_flush_failing") == 1, "the failure")
        _fill(small_disk)  # a failed write gives back what it had taken: the disk stays full
        # the store may have taken the first lines (the lake lags it by up to 5 s, and fails
        # once it is written); from then on flushes wait for the lake, and lines pile up
        deadline = time.monotonic() + 90
        while (_gauge(port, "servescope_collector_pending_bytes") or 0) <= 1_000_000:
            assert time.monotonic() < deadline, "timed out waiting for tailing on while failing"
            with events.open("ab") as fh:
                fh.write(_lines(2000 * written, 2000))
            written += 1
            time.sleep(0.5)
        failures = _failures(port)
        assert failures >= 1
        # retried meanwhile: one log line a failing spell (a write that fits in what a failed
        # write gave back ends one: said as well)
        _until(lambda: _failures(port) >= failures + 2, "two more failed flushes")
        said = out.read_text()
        failed, recovered = said.count("flush failed (disk_full"), said.count("commit again")
        assert failed >= 1 and failed - recovered == 1, said[-3000:]
        assert proc.poll() is None
        filler.unlink()  # space is back
        _until(lambda: _gauge(port, "servescope_collector_flush_failing") == 0, "the recovery")
        _until(lambda: (_gauge(port, "servescope_collector_events_written_total") or 0)
               >= 2000 * written, "catching up")  # fmt: skip
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    assert code == 0, out.read_text()[-3000:]
    expected = {f"{RUN}-{i:06d}" for i in range(2000 * written)}
    with Store(store).read() as con:
        ids = [r for (r,) in con.execute("SELECT request_id FROM events").fetchall()]
    assert sorted(ids) == sorted(expected)
    with Lake([lake]).read() as con:
        ids = [r for (r,) in con.execute("SELECT request_id FROM events").fetchall()]
    assert sorted(ids) == sorted(expected)
    shutil.rmtree(lake, ignore_errors=True)
