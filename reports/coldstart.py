"""A server's cold start: the start-up phases vLLM logged (model loading, compilation, CUDA
graphs, engine init, the KV memory it found, time to ready), as the collector recorded them on
the server's session run (`runs.notes.cold_start`, see `wire.vllm_log.PHASES`).

A bench run has no start-up of its own: its cold start is the one of the server session that
served its requests (when one did, as under an experiment's sidecar). A diff puts the two
sides' phases next to each other; they are single measurements, so a difference has no
interval and no verdict.
"""

from __future__ import annotations

from typing import Any

import duckdb

from servescope.store import reads
from servescope.store.reads import RunRow

# (key in notes.cold_start, what people call it, unit), in the order vLLM starts
PHASES = (
    ("ready_s", "first log line → Application startup complete", "s"),
    ("model_load_s", "model loading", "s"),
    ("model_load_gib", "model loading: weights memory", "GiB"),
    ("weights_load_s", "loading weights", "s"),
    ("dynamo_transform_s", "Dynamo bytecode transform", "s"),
    ("graph_compile_s", "compiling graphs (all compile ranges)", "s"),
    ("compile_cache_load_s", "loading compiled graphs from the cache", "s"),
    ("torch_compile_s", "torch.compile in total", "s"),
    ("profile_run_s", "initial profiling/warm-up run", "s"),
    ("memory_profiling_s", "memory profiling", "s"),
    ("activation_peak_gib", "profiled activation peak", "GiB"),
    ("non_torch_gib", "profiled non-torch memory", "GiB"),
    ("cudagraph_estimate_gib", "CUDA graph memory estimate", "GiB"),
    ("kv_cache_available_gib", "available KV cache memory", "GiB"),
    ("cudagraph_capture_s", "CUDA graph capture", "s"),
    ("cudagraph_gib", "CUDA graph capture: memory", "GiB"),
    ("init_engine_s", "init engine (profile, KV cache, warm-up)", "s"),
    ("init_engine_compile_s", "init engine: of which compilation", "s"),
)


def cold_start_of(con: duckdb.DuckDBPyConnection, run: RunRow) -> dict[str, Any] | None:
    """{`session`: the run the phases were logged in, `phases`: the numbers}; None when neither
    the run nor the one session that served it recorded a start-up."""
    own = (run["notes"] or {}).get("cold_start")
    if own:
        return {"session": run["run_id"], "phases": own}
    found = [
        (session, phases)
        for session, notes in reads.serving_sessions(con, run["run_id"])
        if (phases := notes.get("cold_start"))
    ]
    if len(found) != 1:
        return None  # several servers (or none) served it: no one start-up is the run's
    return {"session": found[0][0], "phases": found[0][1]}


def rows(cold: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One row per phase the server logged: phase, label, unit, value."""
    phases = (cold or {}).get("phases") or {}
    return [
        {"phase": key, "label": label, "unit": unit, "value": phases[key]}
        for key, label, unit in PHASES
        if phases.get(key) is not None
    ]


def diff_rows(before: dict[str, Any] | None, after: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One row per phase either side logged: before, after, Δ and Δ % (single measurements:
    no interval, no verdict)."""
    b = (before or {}).get("phases") or {}
    a = (after or {}).get("phases") or {}
    out = []
    for key, label, unit in PHASES:
        x, y = b.get(key), a.get(key)
        if x is None and y is None:
            continue
        delta = y - x if x is not None and y is not None else None
        out.append({
            "phase": key, "label": label, "unit": unit, "before": x, "after": y, "delta": delta,
            "delta_pct": delta / x * 100.0 if delta is not None and x else None,
        })  # fmt: skip
    return out
