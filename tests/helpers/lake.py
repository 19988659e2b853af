"""The lake tests' shape (sidecars, runs, steps), and a collector sidecar's own /metrics read
while it starts."""

from __future__ import annotations

import re
import subprocess
import time
import urllib.request
from pathlib import Path

RUNS = ("run-20261125-lake-base", "run-20261125-lake-new")
SIDECARS = 3
PER_SIDECAR = 3000  # request records per sidecar
STEPS = 30


def collector_metrics(port: int) -> str:
    """The collector's /metrics page, or "" while it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            return resp.read().decode()
    except OSError:
        return ""


def wait_collector_up(process: subprocess.Popen[bytes], port: int, out: Path) -> None:
    """Until the collector on `port` has flushed once (its output, `out`, shown if it exits)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, out.read_text(errors="replace")[-3000:]
        found = re.search(r"^servescope_collector_last_flush_timestamp_seconds (\S+)$",
                          collector_metrics(port), re.M)  # fmt: skip
        if found and float(found[1]) > 0:
            return
        time.sleep(0.1)
    raise AssertionError("the collector did not come up")
