"""The collector as the sidecar of the servers an experiment starts.

Process management only: `servescope collect` runs as its own process, exactly as an operator
runs it next to their vLLM, so what an experiment measures is what production would see.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from servescope.store import Store, settings

Notice = Callable[[str, bool], None]


def _quiet(message: str, warning: bool = False) -> None:
    pass


# vLLM exports a request's span within seconds of its end on a quiet machine; on a busy one its
# exporter (a batch every 5 s) and the collector's flush can fall far behind. `settle` returns the
# moment every trace is in: this is only how long it waits for stragglers before going on.
SETTLE_S = 90.0
START_TRIES = 3  # collector starts, each on a new port, before the experiment gives up


class CollectorSidecar:
    """`servescope collect` next to an experiment's servers, as an operator runs it next to
    theirs: the log they append to tailed, their traces received, their `/metrics` scraped,
    into the experiment's store. Each server becomes a session run joined with the bench
    runs by request id, so the reports hold vLLM's queue, prefill and decode times and its own
    TTFT beside the client's."""

    def __init__(self, store: Store, log: Path, url: str, *, notice: Notice = _quiet) -> None:
        self.store = store
        self.notice = notice
        self.env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
        log.parent.mkdir(parents=True, exist_ok=True)
        self.output = log.with_suffix(".collector.log")
        # A free port can be taken by another process between the look and the collector's
        # bind: a collector that exits before it listens is started again on another port
        # (vLLM, started after it, is told the port that took).
        for attempt in range(1, START_TRIES + 1):
            otlp_port = settings.free_port()
            self.process = self._start(log, url, otlp_port)
            if self._listening(otlp_port):
                break
            if self.process.poll() is None or attempt == START_TRIES:
                self.process.kill()
                raise RuntimeError(f"the collector did not start: see {self.output}")
        self.flags = ["--otlp-traces-endpoint", f"http://127.0.0.1:{otlp_port}/v1/traces"]
        self.notice(f"collector sidecar (pid {self.process.pid}) → {self.output}", False)

    def _start(self, log: Path, url: str, otlp_port: int) -> subprocess.Popen[bytes]:
        command = [
            sys.executable, "-m", "servescope.cli", "collect", "--vllm-log", str(log),
            "--otlp-port", str(otlp_port), "--metrics-url", f"{url}/metrics",
            "--scrape-interval", "1", "--metrics-port", "0", "--store", str(self.store.path),
        ]  # fmt: skip
        with self.output.open("ab") as out:
            return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)

    def _listening(self, otlp_port: int) -> bool:
        """Whether this collector listens on `otlp_port` (False: it exited first, or a minute
        went by)."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.process.poll() is None:
            with contextlib.suppress(psutil.Error):  # its socket, not one another process took
                sockets = psutil.Process(self.process.pid).net_connections(kind="tcp")
                if any(c.status == psutil.CONN_LISTEN and c.laddr.port == otlp_port
                       for c in sockets):  # fmt: skip
                    return True
            time.sleep(0.2)
        return False

    def settle(self, run_id: str) -> None:
        """Wait until vLLM's trace of every successful request of the run is stored."""
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline and self.process.poll() is None:
            ok, traced = self.store.traced_requests(run_id)
            if traced >= ok:
                return
            time.sleep(0.5)
        self.notice(f"{run_id}: some vLLM traces did not arrive in {SETTLE_S:.0f} s", True)

    def close(self) -> None:
        self.process.terminate()  # flushes what it read, exits 0
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
