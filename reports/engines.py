"""One vLLM server of several engines (`--data-parallel-size N`) by engine, and its GPUs.

A data-parallel server is one process tree behind one URL: N engines, each a whole copy of the
model on its own GPUs with its own scheduler and its own KV cache. vLLM labels every `/metrics`
series with its `engine`, and each engine states its own KV cache at start-up (`(EngineCore_DP1
…) GPU KV cache size: …`, kept by the collector in the session's `notes.engines`). The run's
own numbers stay the server's as a whole: counters and the running and waiting requests summed
over the engines, the KV-cache usage of the fullest one. This section says how the work was
split: per engine, vLLM's KV statement and the memory it found, requests finished, tokens,
preemptions, prefix-cache hit ratio, and the running and waiting requests (peak and mean over
the samples, each engine's own, not averaged with the others'); and the skew of each across the
engines (max / mean, coefficient of variation), as for the replicas of a fleet
(reports/replicas.py), since a data-parallel server balances requests by its own rule.

`gpus`: each GPU's memory as its worker stated it (weights loaded, available KV cache memory),
from the session's `notes.gpus`, with the server's tensor-, pipeline- and data-parallel sizes
(`notes.parallel`) — what a server of more than one GPU holds on each.

A run gets this section when its samples carry more than one engine, or when the session that
served it ran on more than one GPU; otherwise it is None.
"""

from __future__ import annotations

from typing import Any

import duckdb

from servescope.reports import sql
from servescope.reports.replicas import skew
from servescope.reports.samples import Slice
from servescope.store import reads
from servescope.store.notes import SESSION_KIND, RunNotes
from servescope.store.reads import RunRow

COUNTERS = {
    "requests_finished": "vllm:request_success_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "preemptions": "vllm:num_preemptions_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
}
GAUGES = {
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "kv_cache_usage": "vllm:kv_cache_usage_perc",
}
INDICATORS = (
    "requests_finished",
    "generation_tokens",
    "running_mean",
    "waiting_peak",
    "kv_cache_usage_peak",
    "preemptions",
    "prefix_cache_hit_ratio",
)
# What each GPU's worker states about its memory (wire/vllm_log.py PHASES), in GiB
GPU_MEMORY = ("model_load_gib", "kv_cache_available_gib")


def _order(engine: str | None) -> tuple[int, str]:
    text = engine or ""
    return (int(text) if text.isdigit() else 1 << 30, text)


def _serving_session(con: duckdb.DuckDBPyConnection, run: RunRow) -> tuple[str | None, RunNotes]:
    """The server session the run is, or the one session that served it, with its notes."""
    own = run["notes"] or {}
    if own.get("kind") == SESSION_KIND:
        return run["run_id"], own
    found = reads.serving_sessions(con, run["run_id"])
    return found[0] if len(found) == 1 else (None, {})


def engine_rows(
    con: duckdb.DuckDBPyConnection, part: Slice, statements: dict[str, Any]
) -> list[dict[str, Any]]:
    """One row per engine the slice's samples name (per scraped target when there are
    several), with that engine's KV statement from `statements` (by engine)."""
    params = part.params()
    seen = con.execute(sql.ENGINES_SCRAPED, params).fetchall()
    targets = {target for target, _ in seen}
    rows: dict[tuple[str, str], dict[str, Any]] = {
        (target, engine): {"engine": engine, "target": target if len(targets) > 1 else None}
        for target, engine in seen
    }
    counters = {name: key for key, name in COUNTERS.items()}
    for target, engine, name, delta, steps in con.execute(
        sql.COUNTERS_BY_ENGINE, {**params, "names": list(counters)}
    ).fetchall():
        if (target, engine) in rows:
            rows[(target, engine)][counters[name]] = delta if steps else None
    gauges = {name: key for key, name in GAUGES.items()}
    for target, engine, name, peak, mean in con.execute(
        sql.GAUGES_BY_ENGINE, {**params, "names": list(gauges)}
    ).fetchall():
        if (target, engine) in rows:
            rows[(target, engine)][f"{gauges[name]}_peak"] = peak
            rows[(target, engine)][f"{gauges[name]}_mean"] = mean
    out = []
    for row in rows.values():
        hits, asked = row.get("prefix_cache_hits"), row.get("prefix_cache_queries")
        row["prefix_cache_hit_ratio"] = hits / asked if hits is not None and asked else None
        stated = ((statements.get(row["engine"]) or {}).get("kv_cache")) or {}
        row["kv_cache_tokens"] = stated.get("kv_cache_tokens")
        row["max_concurrency"] = stated.get("max_concurrency")
        out.append(row)
    return sorted(out, key=lambda r: (r["target"] or "", _order(r["engine"])))


def gpu_rows(gpus: dict[str, Any]) -> list[dict[str, Any]]:
    """Each GPU's memory as its worker stated it (`notes.gpus`: `dp<E>-tp<R>` → GiB figures)."""
    out = []
    for key, figures in gpus.items():
        if not isinstance(figures, dict):
            continue
        engine, _, rank = key.removeprefix("dp").partition("-tp")
        out.append({"gpu": key, "engine": engine, "rank": rank,
                    **{name: figures.get(name) for name in GPU_MEMORY}})  # fmt: skip
    return sorted(out, key=lambda r: (_order(r["engine"]), _order(r["rank"])))


def of_run(con: duckdb.DuckDBPyConnection, part: Slice, run: RunRow) -> dict[str, Any] | None:
    """`{"session", "parallel", "engines", "skew", "gpus", "device"}` of a slice served by one
    server of several engines or GPUs; None otherwise."""
    session_id, session = _serving_session(con, run)
    rows = engine_rows(con, part, session.get("engines") or {})
    parallel = session.get("parallel")
    gpus = gpu_rows(session.get("gpus") or {})
    if len(rows) < 2 and (parallel.get("gpus", 1) if parallel else 1) < 2:
        return None
    kv_cache = session.get("kv_cache")
    stated = kv_cache.get("vllm") if kv_cache else None
    return {
        "session": session_id,
        "parallel": parallel or None,
        "engines": rows if len(rows) > 1 else [],
        "skew": skew(rows, INDICATORS, key="engine") if len(rows) > 1 else None,
        "gpus": gpus,
        # where vLLM put its KV cache (`CPU`, `GPU`): a CPU server's memory figures are host
        # memory, never labelled a GPU's
        "device": stated.get("kv_cache_device") if stated else None,
    }
