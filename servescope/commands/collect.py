"""`servescope collect`: the collector sidecar (vLLM logs, .events.jsonl files, OTLP traces and
/metrics into the store), or a one-shot import of files with `--once`."""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import threading
from pathlib import Path
from types import FrameType

from servescope.collector import Collector
from servescope.collector.gpu import GPU_MODES, GpuSource, NoGpu, open_gpu_source
from servescope.collector.otlp_export import OtlpExport, StoredRequestForwarder
from servescope.collector.selfmetrics import SelfMetrics
from servescope.collector.sessions import default_instance, instance_name
from servescope.collector.sources import Source
from servescope.collector.sources.events import EventsFiles
from servescope.collector.sources.gpu import GpuTelemetry
from servescope.collector.sources.logs import VllmLog
from servescope.collector.sources.metrics import MetricsTarget
from servescope.collector.sources.otlp import OtlpTraces
from servescope.commands.common import (
    UsageError,
    add_store_option,
    byte_progress,
    console,
    open_store,
)
from servescope.store import retention, settings
from servescope.store.lake import LakeUnavailable, LakeWriter

DESCRIPTION = (
    "Tail vLLM server logs (text or JSON format, detected per line) and .events.jsonl files, "
    "scrape vLLM /metrics, and receive vLLM's OTLP traces; join everything per request "
    "(vLLM ids map back to the client's X-Request-Id) and write it to the store exactly once. "
    "Checkpoints are saved with the rows they cover, so a restart (even after SIGKILL) resumes "
    "where the last flush ended; rotation (rename or copytruncate), truncation and deletion are "
    "followed. Bad input goes to ingest_errors with its source, offset and reason. SIGTERM or "
    "Ctrl-C flushes and exits 0. Exit codes: 0 done, 1 the store could not be written, 2 bad "
    "usage."
)


# A declarative table (argparse set-up, one statement per option): longer than 80 lines by
# design, as the house rule allows.
def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "collect",
        help="the collector sidecar: logs, events, traces, metrics → store",
        description=DESCRIPTION,
    )
    parser.add_argument(
        "--vllm-log",
        action="append",
        default=[],
        metavar="PATH",
        help="a vLLM server log to tail (repeatable); start it with --enable-log-requests. "
        "vLLM's own file, or its container's stdout as the runtime keeps it: a pod's log "
        "(/var/log/pods/…/0.log, CRI) or Docker's json-file log, recognized by themselves",
    )
    parser.add_argument(
        "--events",
        action="append",
        default=[],
        metavar="GLOB",
        help="a path or glob of .events.jsonl files to tail (repeatable; quote the glob)",
    )
    parser.add_argument(
        "--metrics-url",
        action="append",
        default=[],
        metavar="URL",
        help="a vLLM /metrics URL to scrape into metric_samples (repeatable)",
    )
    parser.add_argument(
        "--scrape-interval",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds between scrapes (default 5)",
    )
    parser.add_argument(
        "--otlp-port",
        type=int,
        default=None,
        metavar="PORT",
        help="receive OTLP/HTTP traces on this port (vLLM: --otlp-traces-endpoint "
        f"http://HOST:PORT/v1/traces; the usual port is {settings.OTLP_PORT})",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=settings.COLLECTOR_METRICS_PORT,
        metavar="PORT",
        help="serve the collector's own /metrics here "
        f"(default {settings.COLLECTOR_METRICS_PORT}; 0 = any free port)",
    )
    parser.add_argument(
        "--host",
        default=settings.HOST,
        help=f"address the receivers bind (default {settings.HOST})",
    )
    parser.add_argument(
        "--instance",
        default=None,
        metavar="NAME",
        help="this host's name in the run ids of the server sessions it records, "
        "vllm-<model>-<instance>-<port>-<UTC start>, and in their runs rows (notes.instance): "
        "two nodes that start the same model on the same port in the same second stay two "
        f"runs in a shared store or lake (default ${settings.INSTANCE_ENV}, else the host "
        "name; letters, digits, '.', '_' and '-', anything else becomes '-'). Keep it stable: "
        "a restart pairs with the session before it only within one instance",
    )
    parser.add_argument(
        "--otlp-export",
        default=None,
        metavar="URL",
        help="forward each stored request as an OTLP span with GenAI attributes, plus GenAI "
        "metrics, to this OTLP endpoint (an OpenTelemetry Collector, e.g. "
        "http://127.0.0.1:4318; gRPC with OTEL_EXPORTER_OTLP_PROTOCOL=grpc). Batched, retried, "
        "bounded: an unreachable endpoint never slows ingestion; dropped spans are counted in "
        "servescope_collector_export_dropped_total. Other OTEL_EXPORTER_OTLP_* variables apply",
    )
    parser.add_argument(
        "--gpu",
        default="auto",
        metavar="auto|on|off|IDS",
        help="GPU telemetry through NVML every --scrape-interval into metric_samples, under "
        "dcgm-exporter's names: auto (default) = on when NVML finds a GPU; on = fail without "
        "one; IDS = only these GPUs, by index or UUID (0,1 or GPU-…), from NVML or from "
        "--dcgm-url's page. NVML reads the GPUs of CUDA_VISIBLE_DEVICES when it is set. Each "
        "GPU's readings belong to the server whose processes use it (else whose "
        "CUDA_VISIBLE_DEVICES names it): two servers on two GPUs each get their own energy. "
        "Not with --once",
    )
    parser.add_argument(
        "--dcgm-url",
        default=None,
        metavar="URL",
        help="scrape a dcgm-exporter /metrics (e.g. http://127.0.0.1:9400/metrics) for the GPU "
        "samples instead of NVML",
    )
    parser.add_argument(
        "--once",
        action="store_true",
        help="ingest what the files hold now (and scrape once), then exit",
    )
    parser.add_argument(
        "--json", action="store_true", help="print totals as JSON on exit (for scripts)"
    )
    parser.add_argument(
        "--lake",
        default=None,
        metavar="DIR|URI",
        help="also write every committed flush to this shared lake: a Delta Lake table per "
        "store table, in a folder (local, NFS) or object storage (s3://bucket/prefix, gs://, "
        "az://; credentials from the usual environment variables, AWS_ACCESS_KEY_ID …). Many "
        "sidecars on many hosts write one lake; reports read it with --lake, as do DuckDB, "
        "ClickHouse, Polars and Spark with their Delta readers (docs/lake.md)",
    )
    parser.add_argument(
        "--retain",
        default=None,
        metavar="DURATION",
        help="keep the /metrics samples this long (36h, 14d, 2w): at start and every 5 "
        "minutes, samples older than that are dropped, and those older than 24 hours are "
        "downsampled to one a minute per series (the minute's last value: right for counters' "
        "rate(), a gauge's closing value). Requests, runs, lever flips, runtime events and "
        "ingest errors are kept. Default: keep every sample. `servescope store prune` does the "
        "same once",
    )
    add_store_option(parser)
    parser.set_defaults(func=run_collect)


def _usage_error(args: argparse.Namespace) -> str | None:
    if not (args.vllm_log or args.events or args.metrics_url or args.otlp_port is not None):
        return "nothing to collect: give --vllm-log, --events, --metrics-url or --otlp-port"
    if args.once and args.otlp_port is not None:
        return "--once reads files and exits; it cannot receive traces (drop --otlp-port)"
    if args.scrape_interval <= 0:
        return "--scrape-interval must be positive"
    if args.instance is not None and not instance_name(args.instance):
        return f"--instance {args.instance!r}: give a name with letters or digits"
    if args.gpu not in GPU_MODES:
        names = [n.strip() for n in args.gpu.split(",")]
        bad = [n for n in names if not (n.isdigit() or n.startswith("GPU-"))]
        if bad or not names:
            return (
                f"--gpu {args.gpu}: give auto, on, off, or GPU indices or UUIDs (0,1 or "
                f"GPU-…), not {', '.join(map(repr, bad)) or 'nothing'}"
            )
    if args.once:
        for path in args.vllm_log:
            if not Path(path).is_file():
                return f"no such log file: {path}"
        for pattern in args.events:
            if not glob.glob(pattern):
                return f"no file matches --events {pattern}"
    return None


def run_collect(args: argparse.Namespace) -> int:
    problem = _usage_error(args)
    if problem:
        console.print(f"{problem}", style="red")
        return 2
    try:
        retain = retention.parse_duration(args.retain) if args.retain is not None else None
    except retention.BadRetention as exc:
        raise UsageError(f"--retain: {exc}") from None
    gpu = None
    if not args.once:
        try:
            gpu, said = open_gpu_source(args.gpu, args.dcgm_url)
        except NoGpu as exc:
            console.print(f"--gpu {args.gpu}: no GPU ({exc})", style="red")
            return 2
        console.print(said)
    metrics = SelfMetrics()
    store = open_store(args, create=True)
    try:
        lake = LakeWriter(args.lake, store) if args.lake is not None else None
    except (OSError, LakeUnavailable) as exc:
        console.print(f"cannot write the lake at {args.lake}: {exc}", style="red")
        return 1
    otlp = OtlpTraces(args.host, args.otlp_port) if args.otlp_port is not None else None
    collector = Collector(
        store,
        _sources(args, gpu, otlp),
        lake=lake,
        scrape_interval=args.scrape_interval,
        once=args.once,
        metrics=metrics,
        want_keys=bool(args.otlp_export),
        retain=retain,
        instance=instance_name(args.instance) if args.instance else default_instance(),
    )
    forwarder = None
    if args.otlp_export:
        export = OtlpExport(args.otlp_export, registry=metrics.registry)
        forwarder = StoredRequestForwarder(collector.store, export)
        collector.exporters.append(forwarder)
    try:
        if args.once:
            _run_once(collector)
        else:
            code = _run_forever(collector, metrics, otlp, args)
            if code:
                return code
    finally:
        if forwarder is not None:
            forwarder.close()
    if args.json:
        print(json.dumps(dict(collector.totals)))
    else:
        t = collector.totals
        console.print(
            f"{t['events']} request records committed (a request's log, trace and client "
            f"records merge into one event), {t['errors']} lines quarantined, "
            f"{t['samples']} metric samples, {t['flips']} lever flips"
        )
    return 0


def _run_once(collector: Collector) -> None:
    total = collector.backlog_bytes() or 1
    with byte_progress("ingesting") as progress:
        task = progress.add_task("ingest", total=total)
        collector.run_once(on_read=lambda n: progress.advance(task, n))


def _sources(
    args: argparse.Namespace, gpu: GpuSource | None, otlp: OtlpTraces | None
) -> list[Source]:
    """The sources the options name, in the order they are read: events files, vLLM logs,
    `/metrics` targets, the GPUs, the trace receiver."""
    sources: list[Source] = [EventsFiles(pattern) for pattern in args.events]
    sources += [VllmLog(path) for path in args.vllm_log]
    sources += [MetricsTarget(url) for url in args.metrics_url]
    if gpu is not None:
        sources.append(GpuTelemetry(gpu))
    if otlp is not None:
        sources.append(otlp)
    return sources


def _run_forever(
    collector: Collector, metrics: SelfMetrics, otlp: OtlpTraces | None, args: argparse.Namespace
) -> int:
    stop = threading.Event()

    def _stop(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        port = metrics.serve(args.metrics_port, args.host)
        collector.start()
    except OSError as exc:
        console.print(f"cannot listen: {exc}", style="red")
        collector.close()
        return 2
    parts = [f"/metrics on http://{args.host}:{port}/metrics"]
    if otlp is not None:
        parts.append(f"OTLP traces on http://{args.host}:{otlp.port}/v1/traces")
    console.print(f"collector running (pid {os.getpid()}): " + "; ".join(parts))
    collector.run(stop)
    return 0
