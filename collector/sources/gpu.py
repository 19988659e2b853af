"""GPU telemetry as a source: each reading of `collector/gpu.py`'s `GpuSource` (NVML or a
dcgm-exporter page) goes into the batch as samples of the server session using each GPU. The
reading and the attribution are gpu.py's; this module only times them with the scrapes and
hands them the sessions running now."""

from __future__ import annotations

from servescope.collector.batch import Intake
from servescope.collector.gpu import GpuSource
from servescope.collector.sessions import Session
from servescope.collector.sources import Source


class GpuTelemetry(Source):
    """This host's GPUs (or a dcgm-exporter's), read every scrape interval; the collector's own
    `/metrics` shows the GPUs each used by one server (`servescope_gpu_server_info`)."""

    periodic = True
    intake: Intake

    def __init__(self, gpu: GpuSource) -> None:
        self.gpu = gpu
        self.name = f"gpu:{gpu.name}"

    def open(self, intake: Intake) -> None:
        self.intake = intake

    def poll(self) -> int:
        """One reading, outside the batch's lock (NVML or an HTTP request may be slow); the
        sessions running are asked for after the GPUs are read, so a server that started
        meanwhile is one of them."""
        intake = self.intake

        def running() -> list[Session]:
            with intake.batch():
                sessions = intake.attribution.sessions()
            return [s for s in sessions if s.ended_at is None and s.run_id]

        samples = self.gpu.read(running)
        intake.metrics.gpu_servers(self.gpu.owned)
        with intake.batch() as batch:
            batch.touch()
            batch.lines[self.name] += 1
            batch.samples.extend(samples)
        return 1
