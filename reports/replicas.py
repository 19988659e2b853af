"""A fleet run by replica: who served what, how fast, how well each replica's cache hit, and how
unevenly the load and the indicators are spread.

A fleet run is a run whose requests went through the gateway to a pool of replicas: its events
carry `upstream` (the replica that served each one; a bench client reads it from the gateway's
`X-Servescope-Upstream` header) and its `runs.notes.replicas` maps replica names to the URLs
whose `/metrics` were scraped into the run (`bench run --replica NAME=URL`). From the events, per
replica: requests, errors by class, TTFT p50/p95 of the successful ones, the routing reasons;
from each replica's own scraped samples: the prefix-cache hit ratio (Δhits / Δqueries), KV-cache
usage peak, preemptions, vLLM's count of finished requests, and the queue-time p95 from vLLM's
`request_queue_time_seconds` histogram (bucket-interpolated like Prometheus's
`histogram_quantile`; reports/histograms.py); from the GPU samples its server session owned
(the collector attributes each GPU to the server whose processes use it): energy, J per output
token and per request (`gpu.replica_energy`).

The skew of each indicator across the replicas that served requests is `max / mean` (1 = even;
2 on two replicas = one did everything) and the coefficient of variation (population standard
deviation / mean; 0 = even). Requests that reached no replica (refused before routing, or the
gateway unreachable) are one more row, `replica = null`, so the table accounts for every request.

A run is a fleet run when its notes name replicas, or when its first events carry a routing
policy (`routing`, written by the gateway for pooled models): other runs pay one small query.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import duckdb

from servescope.reports import gpu, sql
from servescope.reports.document import (
    Change,
    Fleet,
    ReplicaChange,
    ReplicaRow,
    ReplicasServer,
    Spread,
)
from servescope.reports.histograms import bucket_bound, histogram_quantile
from servescope.reports.prometheus import server_side
from servescope.reports.samples import Slice
from servescope.store import reads

INDICATORS = (
    "requests",
    "ttft_ms_p50",
    "ttft_ms_p95",
    "queue_ms_p95",
    "prefix_cache_hit_ratio",
    "kv_cache_usage_peak",
    "preemptions",
    "errors",
    "j_per_output_token",
)

COUNTERS = (
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:num_preemptions_total",
    "vllm:request_success_total",
)
GAUGES = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")
# vLLM's histograms whose p95 each row gets (bucket growth → Prometheus's histogram_quantile)
HISTOGRAMS = {
    "queue": "vllm:request_queue_time_seconds_bucket",
    "server_ttft": "vllm:time_to_first_token_seconds_bucket",
    "prefill": "vllm:request_prefill_time_seconds_bucket",
    "decode": "vllm:request_decode_time_seconds_bucket",
}


def is_fleet(con: duckdb.DuckDBPyConnection, run: Mapping[str, Any]) -> bool:
    """Does the run's notes name replicas, or do its events carry routing decisions?"""
    if (run.get("notes") or {}).get("replicas"):
        return True
    return reads.is_routed(con, run["run_id"])


# Per scraped target (a URL): counter growth, gauge peaks and `<key>_p95_s` by name
ServerNumbers = dict[str, dict[str, float | None]]


def _server_side(con: duckdb.DuckDBPyConnection, part: Slice) -> ServerNumbers:
    """Per scraped target: counter deltas, gauge peaks and the queue-time histogram's p95."""
    params = part.params()
    out: ServerNumbers = {}
    for target, name, delta, steps in con.execute(
        sql.COUNTERS_BY_TARGET, {**params, "names": list(COUNTERS)}
    ).fetchall():
        out.setdefault(target, {})[name] = delta if steps else None
    for target, name, peak in con.execute(
        sql.GAUGE_PEAKS_BY_TARGET, {**params, "names": list(GAUGES)}
    ).fetchall():
        out.setdefault(target, {})[name] = peak
    keys = {name: key for key, name in HISTOGRAMS.items()}
    buckets: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for target, name, le, delta, steps in con.execute(
        sql.BUCKETS_BY_TARGET, {**params, "names": list(HISTOGRAMS.values())}
    ).fetchall():
        if steps and le is not None:
            buckets.setdefault((target, name), []).append((bucket_bound(le), delta))
    for (target, name), series in buckets.items():
        out.setdefault(target, {})[f"{keys[name]}_p95_s"] = histogram_quantile(0.95, series)
    return out


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def replica_rows(
    con: duckdb.DuckDBPyConnection,
    part: Slice,
    urls: dict[str, str],
    server: ServerNumbers | None = None,
) -> list[ReplicaRow]:
    """One row per replica (and one for requests that reached none), events and server numbers
    joined by the replica's URL in the run's notes; `server` (by URL) replaces servescope's own
    scrapes (reports/prometheus.py)."""
    params = part.params()
    rows = reads.rows(con.execute(sql.BY_REPLICA, params))
    errors: dict[str | None, dict[str, int]] = {}
    for replica, cls, n in con.execute(sql.ERRORS_BY_REPLICA, params).fetchall():
        errors.setdefault(replica, {})[cls] = n
    reasons: dict[str | None, dict[str, int]] = {}
    for replica, reason, n in con.execute(sql.REASONS_BY_REPLICA, params).fetchall():
        reasons.setdefault(replica, {})[reason] = n
    if server is None:
        server = _server_side(con, part) if urls else {}
    energy = gpu.replica_energy(con, params, urls)
    seen = {r["replica"] for r in rows}
    for name in urls:  # a replica that served nothing is a row too: that is skew
        if name not in seen:
            rows.append({"replica": name, "requests": 0, "ok": 0, "errors": 0,
                         "ttft_ms_p50": None, "ttft_ms_p95": None, "cached_tokens": None,
                         "prompt_tokens": None})  # fmt: skip
    out = []
    for row in rows:
        name = row["replica"]
        url = urls.get(name) if name is not None else None
        scraped = server.get(url, {}) if url else {}
        hits = scraped.get("vllm:prefix_cache_hits_total")
        queries_ = scraped.get("vllm:prefix_cache_queries_total")
        own = energy.get(name) if name is not None else None
        out.append(
            ReplicaRow(
                replica=name,
                url=url,
                requests=row["requests"],
                ok=row["ok"],
                errors=row["errors"],
                errors_by_class=errors.get(name, {}),
                route_reasons=reasons.get(name, {}),
                ttft_ms_p50=row["ttft_ms_p50"],
                ttft_ms_p95=row["ttft_ms_p95"],
                cached_token_ratio=_ratio(row["cached_tokens"], row["prompt_tokens"]),
                queue_ms_p95=_ms(scraped.get("queue_p95_s")),
                server_ttft_ms_p95=_ms(scraped.get("server_ttft_p95_s")),
                prefill_ms_p95=_ms(scraped.get("prefill_p95_s")),
                decode_ms_p95=_ms(scraped.get("decode_p95_s")),
                prefix_cache_hit_ratio=_ratio(hits, queries_),
                prefix_cache_hits=hits,
                prefix_cache_queries=queries_,
                kv_cache_usage_peak=scraped.get("vllm:kv_cache_usage_perc"),
                running_peak=scraped.get("vllm:num_requests_running"),
                waiting_peak=scraped.get("vllm:num_requests_waiting"),
                preemptions=scraped.get("vllm:num_preemptions_total"),
                server_requests_finished=scraped.get("vllm:request_success_total"),
                scraped=bool(scraped),
                gpu=own,
                j_per_output_token=own.get("j_per_output_token") if own else None,
            )
        )
    return sorted(out, key=lambda r: (r["replica"] is None, r["replica"] or ""))


def skew(
    rows: Sequence[Mapping[str, object]],
    indicators: tuple[str, ...] = INDICATORS,
    key: str = "replica",
) -> dict[str, Spread]:
    """Per indicator, across the named replicas (or another `key`: a server's engines) that
    measured it: max, mean, max / mean and the coefficient of variation (population). Ratios
    are None where the mean is 0."""
    named = [r for r in rows if r[key] is not None]
    out: dict[str, Spread] = {}
    for name in indicators:
        values = [float(v) for r in named if isinstance(v := r.get(name), int | float)]
        if not values:
            out[name] = Spread(n=0, max=None, mean=None, max_over_mean=None, cv=None)
            continue
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        out[name] = Spread(
            n=len(values),
            max=max(values),
            min=min(values),
            mean=mean,
            max_over_mean=max(values) / mean if mean else None,
            cv=std / mean if mean else None,
        )
    return out


class NotAFleet(LookupError):
    """`--prometheus` on a run that names no replicas to look up."""


def fleet(
    con: duckdb.DuckDBPyConnection,
    part: Slice,
    run: Mapping[str, Any],
    prometheus: str | None = None,
) -> Fleet:
    """`{"replicas": [...], "skew": {...}}` of a fleet run's slice; both None otherwise. With
    `prometheus` (a URL), the replicas' server numbers come from that Prometheus over the
    slice's window, and `replicas_server` says so."""
    urls = (run.get("notes") or {}).get("replicas") or {}
    urls = urls if isinstance(urls, dict) else {}
    if prometheus and not urls:
        raise NotAFleet(
            f"run {run['run_id']!r} names no replicas (bench run --replica NAME=URL): "
            "--prometheus reads a fleet run's replicas"
        )
    if not is_fleet(con, run):
        return {"replicas": None, "skew": None, "replicas_server": None}
    server, source = None, ReplicasServer(source="servescope scrapes")
    if prometheus:
        start = part.since or run.get("started_at")
        end = part.until or run.get("ended_at")
        if start is None or end is None:
            raise NotAFleet(f"run {run['run_id']!r} has no start or end to ask Prometheus about")
        server, source = server_side(prometheus, urls, start, end, (COUNTERS, GAUGES, HISTOGRAMS))
    rows = replica_rows(con, part, urls, server)
    return {"replicas": rows, "skew": skew(rows), "replicas_server": source}


def replicas_diff(
    before: list[ReplicaRow] | None, after: list[ReplicaRow] | None
) -> list[ReplicaChange] | None:
    """Per replica (matched by name) and indicator: before, after and the change."""
    if not before and not after:
        return None
    by_name = {r["replica"]: r for r in before or []}
    after_by = {r["replica"]: r for r in after or []}
    names = sorted({*by_name, *after_by}, key=lambda n: (n is None, n or ""))
    return [_change(name, by_name.get(name), after_by.get(name)) for name in names]


def _change(name: str | None, b: ReplicaRow | None, a: ReplicaRow | None) -> ReplicaChange:
    """One replica's before, after and change per indicator (a side it is missing on: null)."""

    def of(row: ReplicaRow | None, ind: str) -> float | None:
        view: Mapping[str, object] = row or {}
        value = view.get(ind)
        return value if isinstance(value, int | float) else None  # an int stays one

    def change(ind: str) -> Change:
        old, new = of(b, ind), of(a, ind)
        return Change(
            before=old, after=new, delta=None if old is None or new is None else new - old
        )

    return ReplicaChange(
        replica=name,
        requests=change("requests"),
        ttft_ms_p50=change("ttft_ms_p50"),
        ttft_ms_p95=change("ttft_ms_p95"),
        queue_ms_p95=change("queue_ms_p95"),
        prefix_cache_hit_ratio=change("prefix_cache_hit_ratio"),
        kv_cache_usage_peak=change("kv_cache_usage_peak"),
        preemptions=change("preemptions"),
        errors=change("errors"),
        j_per_output_token=change("j_per_output_token"),
    )
