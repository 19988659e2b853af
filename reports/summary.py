"""The numbers of a run report, computed by the store's SQL and shaped for the templates.

Every field with no data is None (null in JSON): a report never shows a 0 it did not measure.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from store import Store, queries

PERCENTILES = ("p50", "p90", "p95", "p99", "mean")


class UnknownRun(LookupError):
    """The run id is not in the store; `known` lists the runs that are."""

    def __init__(self, run_id: str, known: list[str]) -> None:
        self.run_id = run_id
        self.known = known
        listing = ", ".join(known) if known else "none: the store is empty"
        super().__init__(f"unknown run {run_id!r}; known runs: {listing}")


def _shape(row: dict[str, Any]) -> dict[str, Any]:
    """One summary row of SQL into the report's nested shape."""
    out: dict[str, Any] = {
        "requests": row["requests"],
        "errors": row["errors"],
        "error_rate": row["error_rate"],
    }
    for metric in queries.LATENCY_METRICS:
        out[metric] = {p: row[f"{metric}_{p}"] for p in PERCENTILES}
    out["throughput"] = _throughput(row)
    out["cache_hit_request_ratio"] = row["cache_hit_request_ratio"]
    out["cached_token_ratio"] = row["cached_token_ratio"]
    return out


def _throughput(row: dict[str, Any]) -> dict[str, float | None]:
    first: datetime | None = row["first_ts"]
    last: datetime | None = row["last_end_ts"]
    seconds = (last - first).total_seconds() if first and last else None
    ok = row["requests"] - row["errors"]

    def per_s(value: float | None) -> float | None:
        return value / seconds if value is not None and seconds else None

    return {
        "duration_s": seconds,
        "requests_per_s": per_s(ok) if seconds else None,
        "input_tokens_per_s": per_s(row["input_tokens"]),
        "output_tokens_per_s": per_s(row["output_tokens"]),
    }


def _dicts(cursor: Any) -> list[dict[str, Any]]:
    names = [d[0] for d in cursor.description]
    return [dict(zip(names, values, strict=True)) for values in cursor.fetchall()]


def run_summary(store: Store, run_id: str) -> dict[str, Any]:
    """The report of one run: its metadata, overall numbers and one group per workload level."""
    if not store.has_run(run_id):
        raise UnknownRun(run_id, store.run_ids())
    run = store.run(run_id) or {"run_id": run_id}
    with store.read() as con:
        overall = _dicts(con.execute(queries.RUN_SUMMARY, [run_id]))[0]
        groups = _dicts(con.execute(queries.GROUP_SUMMARIES, [run_id]))
        errors = dict(con.execute(queries.ERRORS_BY_CLASS, [run_id]).fetchall())
    notes = run.get("notes") or {}
    return {
        "run_id": run_id,
        "levers": run.get("levers") or {},
        "run": {
            "target": run.get("target"),
            "model": run.get("model"),
            "vllm_version": run.get("vllm_version"),
            "started_at": _iso(run.get("started_at")),
            "ended_at": _iso(run.get("ended_at")),
            "status": run.get("status"),
            "workload": run.get("workload"),
            "memory_peak_gb": notes.get("memory_peak_gb"),
            "server_ready_s": notes.get("server_ready_s"),
        },
        "overall": {**_shape(overall), "errors_by_class": errors},
        "groups": [
            {"workload": g["workload"], "concurrency": g["concurrency"], **_shape(g)}
            for g in groups
        ],
    }


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() + "Z" if value else None
