"""The collector's sources: one module a source, each behind `Source`, as receivers are in the
OpenTelemetry Collector. A source reads (or is sent) input and adds it to the pending batch
with the checkpoint that covers it; the collector loops over sources, commits the batch and
counts. A new source is one module and one line where `servescope collect` builds its list.

- `events.EventsFiles`: `.events.jsonl` files, tailed, bulk-loaded at commit;
- `logs.VllmLog`: a vLLM log, tailed and parsed line by line into request pieces, samples and
  server sessions;
- `metrics.MetricsTarget`: a vLLM `/metrics` URL, scraped;
- `gpu.GpuTelemetry`: NVML or a dcgm-exporter, read;
- `otlp.OtlpTraces`: an OTLP/HTTP receiver vLLM pushes its traces to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from servescope.collector.batch import Intake


class Source(Protocol):
    """One input of the collector.

    `periodic` says who drives `poll`: the collector's timer thread every scrape interval (a
    scrape, a GPU reading: each read is a snapshot, reading more often gives nothing) or its
    main loop as fast as input comes (a tailed file: the sooner read, the lower the lag). A
    source others push to (a receiver) has nothing to poll and adds input as it arrives.
    """

    name: str  # its checkpoints' key and its `servescope_collector_lines_total` label
    periodic: bool

    def open(self, intake: Intake) -> None:
        """Resume from the last commit (checkpoints, server session), before anything is read:
        called by the collector's constructor, so a backlog is known before reading starts."""
        ...

    def start(self) -> None:
        """Begin receiving (bind, serve): a receiver's failure to listen surfaces here, as an
        OSError, before the collector says it runs."""
        return None

    def poll(self) -> int:
        """Read what is new into the batch; how much was read (0: nothing new)."""
        ...

    def backlog(self) -> int:
        """Bytes known to be waiting that were not read yet (a progress bar's total)."""
        return 0

    def close(self) -> None:
        """Stop receiving and let go of files, after the last flush."""
        return None
