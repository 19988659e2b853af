"""Recorded stand-ins for servers the tests cannot start: a vLLM's `/metrics` across a restart,
a dcgm-exporter's page recorded on a GPU server."""

from __future__ import annotations

import http.server

from tests.helpers.cli import ROOT

GPU_FIXTURES = ROOT / "tests" / "fixtures" / "gpu"


class RestartableVllmMetrics(http.server.BaseHTTPRequestHandler):
    """A stand-in for the `/metrics` of a vLLM restarted with other flags between two scrapes (a
    real restart costs 90 s): `vllm:cache_config_info` with `LABELS` and the labels of `CONFIG`,
    the process start `STARTED`, then `EXTRA`. A test subclasses it, and changes `CONFIG` and
    `STARTED` to restart the server."""

    CONFIG: dict[str, str] = {}
    STARTED = 0.0
    LABELS = 'engine="0"'
    EXTRA = ""

    def do_GET(self) -> None:  # noqa: N802
        labels = ",".join([self.LABELS, *(f'{k}="{v}"' for k, v in self.CONFIG.items())])
        body = (
            f"process_start_time_seconds {self.STARTED}\n"
            "# TYPE vllm:cache_config_info gauge\n"
            f"vllm:cache_config_info{{{labels}}} 1.0\n{self.EXTRA}"
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:
        return


class RecordedDcgmExporter(http.server.BaseHTTPRequestHandler):
    """A dcgm-exporter's `/metrics` page recorded on a GPU server (`tests/fixtures/gpu/`),
    served as it was scraped: a stand-in for the exporter, which needs a GPU."""

    PAGE = GPU_FIXTURES / "dcgm-exporter.txt"

    def do_GET(self) -> None:  # noqa: N802
        body = self.PAGE.read_bytes()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:
        return
