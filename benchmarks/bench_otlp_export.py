"""Does OTLP export slow ingestion, even when the endpoint is down?

Ingestion here is what the collector does per flush: write a batch of request records to the
DuckDB store, then hand the same records to the OTLP forwarder. Three runs over the same records,
each into a fresh store file:
- reference: no export;
- up: export to a live OTLP/HTTP endpoint started here (it accepts every export);
- down: export to a port nothing listens on (the exporter retries, the queue overflows).
Prints records/s per run; the last line is JSON with `ratio` = down / reference throughput
(target ≥ 0.9: an unreachable backend leaves ingestion speed unchanged) and the drop count.

    .venv/bin/python benchmarks/bench_otlp_export.py [--records 5000] [--batch 500] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_sidecar_overhead import NullSink  # noqa: E402  (this folder: sys.path[0])
from prometheus_client import CollectorRegistry  # noqa: E402

from servescope.collector.otlp_export import OtlpExport  # noqa: E402
from servescope.store import Store  # noqa: E402
from servescope.store.settings import free_port  # noqa: E402


def records(n: int) -> list[dict[str, Any]]:
    run = "run-20261122-otlpbench"
    return [
        {
            "request_id": f"{run}-{i:06d}",
            "run_id": run,
            "ts": f"2026-11-22T05:{(i // 60) % 60:02d}:{i % 60:02d}.000000Z",
            "source": "client",
            "model": "tiny",
            "prompt_tokens": 512 + i % 7,
            "completion_tokens": 64,
            "ttft_ms": 80.0 + i % 13,
            "tpot_ms": 12.5,
            "e2e_ms": 900.0,
            "finish_reason": "stop",
            "status": "ok",
            "trace_id": f"{i + 1:032x}",
        }
        for i in range(n)
    ]


def ingest(docs: list[dict[str, Any]], batch: int, export: OtlpExport | None) -> float:
    """Seconds to ingest every record (store write + hand-off to the exporter)."""
    with tempfile.TemporaryDirectory() as folder:
        store = Store(Path(folder) / "bench.duckdb")
        store.add_events(docs[:1])  # schema creation outside the timing
        start = time.perf_counter()
        for i in range(0, len(docs), batch):
            chunk = docs[i : i + batch]
            store.add_events(chunk)
            if export is not None:
                export.submit(chunk)
        return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("OTEL_EXPORTER_OTLP_TIMEOUT", "5")
    docs = records(args.records)

    server = ThreadingHTTPServer(("127.0.0.1", 0), NullSink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    dead_port = free_port()

    urls = {
        "reference": None,
        "up": f"http://127.0.0.1:{server.server_address[1]}",
        "down": f"http://127.0.0.1:{dead_port}",
    }
    # interleaved repeats, best of: the machine is shared, so one run per mode would measure
    # whoever else was busy at that moment
    rates: dict[str, list[float]] = {name: [] for name in urls}
    counts: dict[str, dict[str, float]] = {name: {"exported": 0, "dropped": 0} for name in urls}
    for _ in range(args.repeats):
        for name, url in urls.items():
            export = OtlpExport(url, registry=CollectorRegistry()) if url else None
            rates[name].append(len(docs) / ingest(docs, args.batch, export))
            if export is not None:
                # up: wait until all is delivered; down: what was refused at the door so far
                # (the batches in the worker would only fail later, after the retries)
                export.flush(120 if name == "up" else 0.1)
                counts[name]["exported"] += export.exported()
                counts[name]["dropped"] += export.dropped()
                export.shutdown(1)
    figures = {name: {"records_per_s": max(rates[name]), **counts[name]} for name in urls}
    for name, f in figures.items():
        runs = " ".join(f"{r:.0f}" for r in rates[name])
        print(
            f"{name:9s} {f['records_per_s']:8.0f} records/s (best of {runs})  "
            f"exported {f['exported']:.0f}  dropped {f['dropped']:.0f}"
        )
    server.shutdown()
    ref, down, up = figures["reference"], figures["down"], figures["up"]
    out = {
        "metric": "ingest_records_per_s_with_otlp_endpoint_down",
        "ours": round(down["records_per_s"], 1),
        "reference": round(ref["records_per_s"], 1),
        "ratio": round(down["records_per_s"] / ref["records_per_s"], 3),
        "ratio_endpoint_up": round(up["records_per_s"] / ref["records_per_s"], 3),
        "dropped_when_down": down["dropped"],
        "exported_when_up": up["exported"],
        "records": len(docs),
        "repeats": args.repeats,
        "cpus": os.cpu_count(),
    }
    print(json.dumps(out))
    return 0 if down["dropped"] > 0 and up["exported"] == len(docs) * args.repeats else 1


if __name__ == "__main__":
    sys.exit(main())
