"""The collector's own `/metrics` (what Prometheus scrapes to watch the collector itself, and
what dashboards annotate lever flips from)."""

from __future__ import annotations

from functools import partial
from urllib.parse import urlparse

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server


class SelfMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        counter = partial(Counter, registry=self.registry)
        gauge = partial(Gauge, registry=self.registry)
        self.lines = counter(
            "servescope_collector_lines",
            "Lines (log and events files), spans and scrapes read, by source.",
            ["source"],
        )
        self.events = counter(
            "servescope_collector_events_written",
            "Request records and pieces committed to the store.",
        )
        self.errors = counter(
            "servescope_collector_ingest_errors",
            "Input refused and kept in ingest_errors, by reason.",
            ["reason"],
        )
        self.lag = gauge(
            "servescope_collector_lag_seconds",
            "Age of the oldest input of the last flush when it was committed.",
        )
        self.last_flush = gauge(
            "servescope_collector_last_flush_timestamp_seconds",
            "Unix time of the last committed flush.",
        )
        self.flush_failing = gauge(
            "servescope_collector_flush_failing",
            "1 while flushes fail (a full disk: the store's or the lake's); the batch and the "
            "checkpoints are kept and the flush is retried.",
        )
        self.flush_failures = counter(
            "servescope_collector_flush_failures",
            "Flushes that failed and were kept for a retry, by reason (disk_full, …).",
            ["reason"],
        )
        self.pending = gauge(
            "servescope_collector_pending_bytes",
            "Input read and not committed yet (bounded: reading pauses at one flush's worth).",
        )
        self.pruned = counter(
            "servescope_collector_samples_pruned",
            "Metric samples deleted by --retain: expired (older than the retention) or "
            "downsampled (older than a day, not the last of their minute in their series).",
            ["reason"],
        )
        self.flips = gauge(
            "servescope_lever_flip_info",
            "A lever flip seen by the collector (value: unix time of the flip).",
            ["lever", "before", "after"],
        )
        self.gpu_server = gauge(
            "servescope_gpu_server_info",
            "A GPU (dcgm-exporter's gpu and UUID labels) used by one server alone (`server`: "
            "its host:port as the collector reaches it), as the collector attributes it (by "
            "process, else the server's CUDA_VISIBLE_DEVICES); dashboards join a GPU's energy "
            "to that server's tokens on it. Value 1.",
            ["gpu", "UUID", "server"],
        )

    def gpu_servers(self, owned: dict[tuple[str, str], str]) -> None:
        """The GPUs each used by one server now ((gpu, UUID) → the server's URL); the others'
        series go."""
        self.gpu_server.clear()
        for (index, uuid), target in owned.items():
            self.gpu_server.labels(index, uuid, urlparse(target).netloc or target).set(1)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_address[1])
