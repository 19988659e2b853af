"""Exactly once under faults: 100,000 events written across three rotations (rename, copytruncate,
rename) and partial lines, while `servescope collect` is killed with SIGKILL at random moments
and restarted. Afterwards the store holds every event once: no duplicates, no gaps."""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import duckdb

from tests.conftest import ROOT, SERVESCOPE, free_port

TOTAL = 100_000
STEPS = 200  # the writer's steps: TOTAL / STEPS lines each
ROTATIONS = {50: "rename", 100: "copytruncate", 150: "rename"}  # at these steps


def _line(i: int) -> bytes:
    doc = {
        "request_id": f"run-20261122-faults-{i:06d}",
        "model": "local-coder",
        "prompt_tokens": 100 + i % 900,
        "completion_tokens": 1 + i % 400,
        "ttft_ms": 20 + i % 500,
        "tpot_ms": 5 + i % 40,
        "cache_hit": i % 2 == 0,
        "finish_reason": "stop",
    }
    return (json.dumps(doc) + "\n").encode()


def _start(events: Path, store: Path, out: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            *SERVESCOPE,
            "collect",
            "--events",
            str(events),
            "--store",
            str(store),
            "--metrics-port",
            str(free_port()),
        ],  # fmt: skip
        cwd=ROOT,
        stdout=out.open("ab"),
        stderr=subprocess.STDOUT,
    )


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


def test_sigkill_and_rotation_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    rng = random.Random(20261122)
    events = tmp_path / "events.jsonl"
    store = tmp_path / "store.duckdb"
    out = tmp_path / "collector.out"
    kill_steps = set(rng.sample(range(5, STEPS), 12)) | {51, 101}  # also right after rotations
    per_step = TOTAL // STEPS
    collector = _start(events, store, out)
    kills = 0
    fh = events.open("ab")
    written = 0
    for step in range(STEPS):
        if step in ROTATIONS:
            fh.close()
            rotated = tmp_path / f"events.jsonl.{step // 50}"
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
        time.sleep(rng.uniform(0.0, 0.03))
        fh.write(block[cut:])
        fh.flush()
        written += per_step
        if step in kill_steps:
            time.sleep(rng.uniform(0.0, 0.6))  # anywhere: between flushes or inside one
            collector.send_signal(signal.SIGKILL)
            collector.wait(timeout=30)
            kills += 1
            collector = _start(events, store, out)
    fh.close()
    assert kills >= 10 and written == TOTAL

    deadline = time.monotonic() + 240
    while _count(store) < TOTAL and time.monotonic() < deadline:
        assert collector.poll() is None, out.read_text()[-3000:]
        time.sleep(1)
    collector.send_signal(signal.SIGTERM)
    assert collector.wait(timeout=60) == 0, out.read_text()[-3000:]

    con = duckdb.connect(str(store), read_only=True)
    total, distinct = con.execute(
        "SELECT count(*), count(DISTINCT request_id) FROM events"
    ).fetchone()
    ids = {r[0] for r in con.execute("SELECT request_id FROM events").fetchall()}
    errors = con.execute("SELECT count(*) FROM ingest_errors").fetchone()
    con.close()
    assert (total, distinct) == (TOTAL, TOTAL)
    assert ids == {f"run-20261122-faults-{i:06d}" for i in range(TOTAL)}
    assert errors == (0,)
