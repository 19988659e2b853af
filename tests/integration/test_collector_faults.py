"""Exactly once under faults: 50,000 events written across three rotations (rename, copytruncate,
rename) and partial lines, while `servescope collect` is killed with SIGKILL at random moments
and restarted (each time once it is up again). A file created and rotated away while no collector
ever read from it is outside what any tailer can follow, so the writer rotates a file only once
some collector has committed a line of it, however slow the restarts: the rotation may still
come while that collector lags or is dead. Afterwards the store holds every event once: no
duplicates, no gaps."""

from __future__ import annotations

import json
import random
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import duckdb

from servescope.store.settings import free_port
from tests.helpers.cli import ROOT, SERVESCOPE

TOTAL = 50_000  # 250 lines a step: the kills and rotations fall among steps, not lines
STEPS = 200  # the writer's steps: TOTAL / STEPS lines each
ROTATIONS = {50: "rename", 100: "copytruncate", 150: "rename"}  # at these steps


def _id(i: int) -> str:
    return f"run-20261122-faults-{i:06d}"  # zero-padded: ids sort as their numbers


def _line(i: int) -> bytes:
    doc = {
        "request_id": _id(i),
        "model": "local-coder",
        "prompt_tokens": 100 + i % 900,
        "completion_tokens": 1 + i % 400,
        "ttft_ms": 20 + i % 500,
        "tpot_ms": 5 + i % 40,
        "cache_hit": i % 2 == 0,
        "finish_reason": "stop",
    }
    return (json.dumps(doc) + "\n").encode()


def _start(events: Path, store: Path, out: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    process = subprocess.Popen(
        [*SERVESCOPE, "collect", "--events", str(events), "--store", str(store),
         "--metrics-port", str(port)],
        cwd=ROOT,
        stdout=out.open("ab"),
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    return process, port


def _wait_up(process: subprocess.Popen[bytes], port: int, out: Path) -> None:
    """Until the collector has committed its first flush (its /metrics says when): a collector
    that never lives long enough to commit cannot make progress, however exact it is."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, out.read_text(errors="replace")[-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
                text = resp.read().decode()
        except OSError:
            text = ""
        flushed = re.search(
            r"^servescope_collector_last_flush_timestamp_seconds (\S+)$", text, re.M
        )
        if flushed and float(flushed[1]) > 0:
            return
        time.sleep(0.1)
    raise AssertionError("the collector did not come up")


def _count(store: Path) -> int:
    try:
        con = duckdb.connect(str(store), read_only=True)
    except duckdb.Error:
        return -1  # not created yet, or the collector holds it this instant
    try:
        row = con.execute("SELECT count(*) FROM events").fetchone()
        return int(row[0]) if row else 0
    except duckdb.Error:
        return -1
    finally:
        con.close()


def _committed_from(store: Path, first: int) -> bool:
    """Whether the store holds an event numbered `first` or later (committed with the checkpoint
    of the file it came from)."""
    try:
        con = duckdb.connect(str(store), read_only=True)
    except duckdb.Error:
        return False  # the collector holds it this instant
    try:
        row = con.execute(
            "SELECT count(*) FROM events WHERE request_id >= ?", [_id(first)]
        ).fetchone()
        return bool(row and row[0])
    except duckdb.Error:
        return False
    finally:
        con.close()


def _write(events: Path, store: Path, rng: random.Random, failed: list[str]) -> None:
    """The producer: TOTAL lines in STEPS steps, partial lines, three rotations. A file is
    rotated only once a line of it is committed, so its checkpoint names it."""
    per_step = TOTAL // STEPS
    fh = events.open("ab")
    written = 0
    generation = 0  # the number of the first line of the file at the path
    for step in range(STEPS):
        if step in ROTATIONS:
            deadline = time.monotonic() + 240
            while not _committed_from(store, generation):
                if time.monotonic() > deadline:
                    failed.append(f"no line from {generation} committed before step {step}")
                    break
                time.sleep(0.1)
            generation = written
            fh.close()
            rotated = events.with_name(f"events.jsonl.{step // 50}")
            if ROTATIONS[step] == "rename":
                events.rename(rotated)
            else:
                shutil.copyfile(events, rotated)
                with events.open("r+b") as trunc:
                    trunc.truncate(0)
            fh = events.open("ab")
        block = b"".join(_line(i) for i in range(written, written + per_step))
        cut = rng.randrange(1, len(block) - 1)
        fh.write(block[:cut])  # a partial last line for a while
        fh.flush()
        time.sleep(rng.uniform(0.05, 0.2))
        fh.write(block[cut:])
        fh.flush()
        written += per_step
    fh.close()


def test_sigkill_and_rotation_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    rng = random.Random(20261122)
    events = tmp_path / "events.jsonl"
    store = tmp_path / "store.duckdb"
    out = tmp_path / "collector.out"
    events.touch()
    collector, port = _start(events, store, out)
    _wait_up(collector, port, out)
    failed: list[str] = []
    writer = threading.Thread(
        target=_write, args=(events, store, random.Random(7), failed), daemon=True
    )
    writer.start()
    kills = 0
    while writer.is_alive() or kills < 10:
        time.sleep(rng.uniform(0.2, 2.5))  # anywhere: between flushes or inside one
        collector.send_signal(signal.SIGKILL)
        collector.wait(timeout=30)
        kills += 1
        collector, port = _start(events, store, out)
        _wait_up(collector, port, out)
    writer.join()
    assert not failed, failed

    deadline = time.monotonic() + 240
    while _count(store) < TOTAL and time.monotonic() < deadline:
        assert collector.poll() is None, out.read_text()[-3000:]
        time.sleep(0.25)
    collector.send_signal(signal.SIGTERM)
    assert collector.wait(timeout=60) == 0, out.read_text()[-3000:]

    con = duckdb.connect(str(store), read_only=True)
    total, distinct = con.execute(
        "SELECT count(*), count(DISTINCT request_id) FROM events"
    ).fetchone()
    ids = {r[0] for r in con.execute("SELECT request_id FROM events").fetchall()}
    errors = con.execute("SELECT count(*) FROM ingest_errors").fetchone()
    con.close()
    log = "\n".join(
        line for line in out.read_text(errors="replace").splitlines() if "leaked" not in line
    )
    assert kills >= 10
    assert (total, distinct) == (TOTAL, TOTAL), log[-4000:]
    assert ids == {_id(i) for i in range(TOTAL)}
    assert errors == (0,)
