"""The collector as the sidecar of the servers an experiment starts.

Process management only: `servescope collect` runs as its own process, exactly as an operator
runs it next to their vLLM, so what an experiment measures is what production would see.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from servescope.store import Store, settings

Notice = Callable[[str, bool], None]


def _quiet(message: str, warning: bool = False) -> None:
    pass


# vLLM exports a request's span within seconds of its end on a quiet machine; on a busy one its
# exporter (a batch every 5 s) and the collector's flush can fall far behind. `settle` returns the
# moment every trace is in: this is only how long it waits for stragglers before going on.
SETTLE_S = 90.0


class CollectorSidecar:
    """`servescope collect` next to an experiment's servers, as an operator runs it next to
    theirs: the log they append to tailed, their traces received, their `/metrics` scraped,
    into the experiment's store. Each server becomes a session run joined with the bench
    runs by request id, so the reports hold vLLM's queue, prefill and decode times and its own
    TTFT beside the client's."""

    def __init__(self, store: Store, log: Path, url: str, *, notice: Notice = _quiet) -> None:
        self.store = store
        self.notice = notice
        otlp_port = settings.free_port()
        self.flags = ["--otlp-traces-endpoint", f"http://127.0.0.1:{otlp_port}/v1/traces"]
        self.env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
        log.parent.mkdir(parents=True, exist_ok=True)
        self.output = log.with_suffix(".collector.log")
        command = [
            sys.executable, "-m", "servescope.cli", "collect", "--vllm-log", str(log),
            "--otlp-port", str(otlp_port), "--metrics-url", f"{url}/metrics",
            "--scrape-interval", "1", "--metrics-port", "0", "--store", str(store.path),
        ]  # fmt: skip
        with self.output.open("ab") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not settings.listening(otlp_port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the collector did not start: see {self.output}")
            time.sleep(0.2)
        self.notice(f"collector sidecar (pid {self.process.pid}) → {self.output}", False)

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
