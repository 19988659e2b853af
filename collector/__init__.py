"""The collector sidecar: vLLM logs, `.events.jsonl` files, OTLP traces and `/metrics` into the
store, one event per request, exactly once."""

from servescope.collector.core import Collector, FlushReport

__all__ = ["Collector", "FlushReport"]
