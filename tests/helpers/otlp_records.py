"""Requests as the store holds them after a run, for the OTLP export tests: two of one trace."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from servescope.store import Store, import_file

RUN = "run-20261122-otlp"


TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


RECORDS: list[dict[str, Any]] = [
    {
        "request_id": f"{RUN}-000001",
        "run_id": RUN,
        "ts": "2026-11-22T05:00:00.250000Z",
        "source": "client",
        "model": "tiny",
        "team": "team-a",
        "prompt_tokens": 1842,
        "completion_tokens": 419,
        "cached_tokens": 1024,
        "ttft_ms": 820.0,
        "tpot_ms": 34.0,
        "e2e_ms": 15066.0,
        "queue_ms": 12.5,
        "prefill_ms": 790.0,
        "decode_ms": 14200.0,
        "finish_reason": "stop",
        "status": "ok",
        "trace_id": TRACE,
    },
    {
        "request_id": f"{RUN}-000002",
        "run_id": RUN,
        "ts": "2026-11-22T05:00:01Z",
        "source": "gateway",
        "model": "tiny",
        "team": "team-b",
        "e2e_ms": 3.0,
        "status": "rejected",
        "error": "rejected:queue_full",
        "http_status": 429,
        "finish_reason": "error",
    },
]


def stored_records(tmp_path: Path) -> list[dict[str, Any]]:
    """The records as the store gives them back (what the collector forwards)."""
    src = tmp_path / "in.events.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    store = Store(tmp_path / "s.duckdb")
    import_file(store, src)
    return store.export_events(RUN)
