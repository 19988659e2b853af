"""The collector sidecar: vLLM logs, `.events.jsonl` files, OTLP traces and `/metrics` into the
store, one event per request, exactly once. Each input is a source (collector/sources/)."""

from servescope.collector.core import Collector
from servescope.collector.writer import FlushReport

__all__ = ["Collector", "FlushReport"]
