"""The numbers of a run report, computed by the store's SQL and shaped for the templates.

Every field with no data is None (null in JSON): a report never shows a 0 it did not measure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import duckdb

from servescope.reports import sql
from servescope.reports.document import (
    Admission,
    Figures,
    Goodput,
    Group,
    Overall,
    Percentiles,
    PhaseMeans,
    Rejection,
    RunMeta,
    Server,
    ServerFigures,
    Shape,
    Summary,
    Team,
    Throughput,
)
from servescope.reports.quantiles import Itl, pooled_itl
from servescope.reports.samples import CLIENT, FIXED_SOURCES, SERVER, SERVER_FIGURES, Samples, Slice
from servescope.reports.sequential import Plan
from servescope.reports.specdecode import spec_decode
from servescope.reports.sql import SliceParams
from servescope.store import reads
from servescope.store.clock import iso_or_none
from servescope.store.reads import RunRow
from servescope.wire.exposition import prefix_cache_hit_ratio
from servescope.wire.slo import SLO_METRICS

# The report's latency rows: the per-request metrics, with the pooled ITL after TPOT.
LATENCY_METRICS = tuple(
    m
    for name in sql.REPORT_LATENCY_METRICS
    for m in ((name, "itl_ms") if name == "tpot_ms" else (name,))
)
# vLLM's own TTFT, TPOT and e2e, shown beside the client's when a run has both
SERVER_METRICS = tuple(SERVER_FIGURES.values())

# Server series a report reads from `metric_samples` (counters are per-slice deltas).
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
PREEMPTIONS, REJECTED = "vllm:num_preemptions_total", "admission_rejected_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
# vLLM's phase histograms: Δ_sum / Δ_count over the slice is the server-side mean of each phase
# (the tuning matrix's evidence: vllm:request_queue_time_seconds, …_prefill_time_seconds).
PHASES = {
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "decode": "vllm:request_decode_time_seconds",
    "ttft": "vllm:time_to_first_token_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
}
PHASE_SERIES = tuple(f"{h}_{part}" for h in PHASES.values() for part in ("sum", "count"))
COUNTERS = (HITS, QUERIES, PREEMPTIONS, REJECTED, PROMPT_TOKENS, *PHASE_SERIES)
GAUGES = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")


class UnknownRun(LookupError):
    """The run id is not in the store; `known` lists the runs that are."""

    def __init__(self, run_id: str, known: list[str]) -> None:
        self.run_id = run_id
        self.known = known
        listing = ", ".join(known) if known else "none: the store is empty"
        super().__init__(f"unknown run {run_id!r}; known runs: {listing}")


@dataclass(frozen=True)
class ReportOptions:
    """What the user adds to the data: SLOs for goodput, prices for the cost check, a seed;
    and whether to draw the charts (only the HTML shows them)."""

    slo: dict[str, float] = field(default_factory=dict)
    gpu_hour_usd: float | None = None
    api_usd_per_1k_tokens: float | None = None
    seed: int | None = None
    charts: bool = True
    prometheus: str | None = None  # a fleet's replica numbers from this Prometheus instead
    plan: Plan | None = None  # the stopping rule's (None: the runs' experiment's, or the default)
    margin_pct: float | None = None  # over the plan's margin (`report build --margin`)
    stopped: tuple[str, str] | None = None  # why an experiment stopped (code, words)


def recorded_slo(run: RunRow) -> dict[str, float]:
    """The SLOs a bench run was given (`notes.client.slo`), for goodput when none are passed."""
    notes = run["notes"] or {}
    slo = (notes.get("client") or {}).get("slo") or notes.get("slo") or {}
    return {k: float(v) for k, v in slo.items() if k in SLO_METRICS and v is not None}


def require_run(con: duckdb.DuckDBPyConnection, run_id: str) -> RunRow:
    """The run's `runs` row (or a bare one for runs known only from events), read on the
    caller's connection; `UnknownRun` names the runs the store does know."""
    if not reads.has_run(con, run_id):
        raise UnknownRun(run_id, reads.run_ids(con))
    return reads.run(con, run_id) or reads.bare_run(run_id)


def _level(row: dict[str, Any]) -> tuple[Any, Any, Any]:
    return (row["workload"], row["concurrency"], row["target_rate"])


QUANTILES = ("p50", "p90", "p95", "p99")


def _percentiles(q: Sequence[float | None] | None, mean: float | None) -> Percentiles:
    """A list-quantile result ([p50, p90, p95, p99] or NULL) and the mean, by name."""
    p50, p90, p95, p99 = q or (None, None, None, None)
    return Percentiles(p50=p50, p90=p90, p95=p95, p99=p99, mean=mean)


def _shape(
    row: dict[str, Any],
    itl: Itl | None,
    slo: dict[str, float],
    sources: dict[str, str],
    errors: dict[str, int],
) -> Figures:
    """One summary row of SQL (a boundary: its columns are the statement's) into the report's
    nested shape; TTFT, TPOT and e2e from the source `sources` names, vLLM's own figures beside
    them when the client's are shown."""

    def latency(metric: str) -> Percentiles:
        figure = SERVER_FIGURES[metric] if sources.get(metric) == SERVER else metric
        return _percentiles(row[f"{metric}_q"], row[f"{figure}_mean"])

    throughput = _throughput(row)
    return Figures(
        requests=row["requests"],
        errors=row["errors"],
        error_rate=row["error_rate"],
        rejected=row["rejected"],
        sources={**FIXED_SOURCES, **sources},
        ttft_ms=latency("ttft_ms"),
        tpot_ms=latency("tpot_ms"),
        itl_ms=_percentiles(itl["q"], itl["mean"]) if itl else _percentiles(None, None),
        e2e_ms=latency("e2e_ms"),
        queue_ms=latency("queue_ms"),
        prefill_ms=latency("prefill_ms"),
        decode_ms=latency("decode_ms"),
        **_beside(row, sources),
        throughput=throughput,
        goodput=_goodput(row, throughput["duration_s"], slo),
        cache_hit_request_ratio=row["cache_hit_request_ratio"],
        cached_token_ratio=row["cached_token_ratio"],
        prompt_tokens_mean=row["prompt_tokens_mean"],
        errors_by_class=errors,
    )


def _beside(row: dict[str, Any], sources: dict[str, str]) -> ServerFigures:
    """vLLM's TTFT, TPOT and e2e where the report shows the client's and the run has vLLM's."""

    def shown(metric: str) -> Percentiles | None:
        server = SERVER_FIGURES[metric]
        if sources.get(metric) != CLIENT or row.get(f"{server}_q") is None:
            return None
        return _percentiles(row[f"{server}_q"], row[f"{server}_mean"])

    out = ServerFigures()
    if (ttft := shown("ttft_ms")) is not None:
        out["server_ttft_ms"] = ttft
    if (tpot := shown("tpot_ms")) is not None:
        out["server_tpot_ms"] = tpot
    if (e2e := shown("e2e_ms")) is not None:
        out["server_e2e_ms"] = e2e
    return out


def _throughput(row: dict[str, Any]) -> Throughput:
    first: datetime | None = row["first_ts"]
    last: datetime | None = row["last_end_ts"]
    seconds = (last - first).total_seconds() if first and last else None
    ok = row["requests"] - row["errors"]

    def per_s(value: float | None) -> float | None:
        return value / seconds if value is not None and seconds else None

    return Throughput(
        duration_s=seconds,
        requests_per_s=per_s(ok) if seconds else None,
        input_tokens_per_s=per_s(row["input_tokens"]),
        output_tokens_per_s=per_s(row["output_tokens"]),
    )


def _goodput(row: dict[str, Any], seconds: float | None, slo: dict[str, float]) -> Goodput | None:
    """vLLM's goodput: requests meeting every SLO, per second and as a share of all requests."""
    if not slo:
        return None
    good = row["good_requests"]
    return Goodput(
        slo=dict(slo),
        good_requests=good,
        ratio=good / row["requests"] if row["requests"] else None,
        requests_per_s=good / seconds if seconds else None,
    )


def _server(con: duckdb.DuckDBPyConnection, part: Slice) -> Server:
    """Server-side numbers from the slice's `/metrics` samples (None when not scraped)."""
    params = part.params()
    deltas = {
        name: (delta if steps else None)
        for name, delta, steps in con.execute(
            sql.SLICE_COUNTER_DELTAS, {**params, "names": list(COUNTERS)}
        ).fetchall()
    }
    peaks = dict(con.execute(sql.SLICE_GAUGE_PEAKS, {**params, "names": list(GAUGES)}).fetchall())
    hits, asked, prompt = deltas.get(HITS), deltas.get(QUERIES), deltas.get(PROMPT_TOKENS)
    ratio, basis = prefix_cache_hit_ratio(hits, asked, prompt)
    return Server(
        prefix_cache_hit_ratio=ratio,
        prefix_cache_hit_ratio_basis=basis,
        prefix_cache_hits=hits,
        prefix_cache_queries=asked,
        preemptions=deltas.get(PREEMPTIONS),
        admission_rejected=deltas.get(REJECTED),
        kv_cache_usage_peak=peaks.get(GAUGES[0]),
        running_peak=peaks.get(GAUGES[1]),
        waiting_peak=peaks.get(GAUGES[2]),
        phase_means_ms=_phase_means(deltas),
        spec_decode=spec_decode(con, part),
    )


def _phase_means(deltas: dict[str, float | None]) -> PhaseMeans:
    """Server-side mean time per phase in ms (None where not scraped or no request finished)."""

    def mean(phase: str) -> float | None:
        histogram = PHASES[phase]
        total, count = deltas.get(f"{histogram}_sum"), deltas.get(f"{histogram}_count")
        return total / count * 1000.0 if total is not None and count else None

    return PhaseMeans(
        queue=mean("queue"),
        prefill=mean("prefill"),
        decode=mean("decode"),
        ttft=mean("ttft"),
        e2e=mean("e2e"),
    )


def _shape_of(con: duckdb.DuckDBPyConnection, params: SliceParams) -> Shape:
    """Token quantiles: what the workload looked like (t-digest estimates: a shape needs no
    exact rank, and a long-lived run's tokens are not held to sort them)."""
    row = reads.rows(con.execute(sql.SLICE_SHAPE, params))[0]
    prompt, output = row["prompt_q"] or [None, None], row["output_q"] or [None, None]
    return Shape(
        prompt_tokens={"p50": prompt[0], "p95": prompt[1]},
        output_tokens={"p50": output[0], "p95": output[1]},
    )


def _figures(samples: Samples) -> tuple[str, ...]:
    """The per-request figures a summary reads: the report's metrics, vLLM's figure for each
    metric reported from it, and vLLM's TTFT beside the client's (both TTFT sources side by
    side; each more figure costs a pass over a long-lived run)."""
    server = [
        figure
        for metric, figure in SERVER_FIGURES.items()
        if samples.sources.get(metric) == SERVER
        or (metric == "ttft_ms" and samples.measured(figure))
    ]
    return (*sql.REPORT_LATENCY_METRICS, *server)


def _overall_quantiles(row: dict[str, Any], samples: Samples) -> dict[str, Any]:
    """The slice's latency quantiles from its sorted per-request samples (what SQL's
    `quantile_cont` gives, without a second pass over the events)."""
    for metric in _figures(samples):
        values = samples.successful(metric)
        row[f"{metric}_q"] = values.quantiles
        row[f"{metric}_mean"] = values.mean
    return row


def summarize(
    con: duckdb.DuckDBPyConnection, part: Slice, options: ReportOptions, samples: Samples
) -> Summary:
    """Overall and per-level numbers of one slice, server-side deltas and admission evidence."""
    params = part.params()
    slo_params = {f"slo_{m}": options.slo.get(m) for m in SLO_METRICS}
    overall = reads.rows(con.execute(sql.SLICE_OVERALL, {**params, **slo_params}))[0]
    overall = _overall_quantiles(overall, samples)
    groups = reads.rows(con.execute(sql.SLICE_LEVELS, {**params, **slo_params}))
    for metric in _figures(samples):
        by_level = samples.level_quantiles(metric)
        for g in groups:
            g[f"{metric}_q"] = by_level.get(g["level_key"])
    itl_all, itl = pooled_itl(con, params, samples.counts.itl_gaps, samples.counts.level_keys)
    errors: dict[tuple[Any, Any, Any], dict[str, int]] = {}
    errors_all: dict[str, int] = {}
    for row in reads.rows(con.execute(sql.SLICE_ERRORS_BY_CLASS, params)):
        errors.setdefault(_level(row), {})[row["class"]] = row["n"]
        errors_all[row["class"]] = errors_all.get(row["class"], 0) + row["n"]
    errors_all = dict(sorted(errors_all.items(), key=lambda kv: (-kv[1], kv[0])))
    return Summary(
        overall=Overall(
            **_shape(overall, itl_all, options.slo, samples.sources, errors_all),
            first_ts=iso_or_none(overall["first_ts"]),
            models=overall["models"],
            shape=_shape_of(con, params),
            one_chunk_streams=samples.one_chunk(),
        ),
        groups=[
            Group(
                workload=g["workload"],
                concurrency=g["concurrency"],
                target_rate=g["target_rate"],
                **_shape(
                    g,
                    itl.get(g["level_key"]),
                    options.slo,
                    samples.sources,
                    errors.get(_level(g), {}),
                ),  # fmt: skip
            )
            for g in groups
        ],
        server=_server(con, part),
        admission=_admission(con, params),
        gpu=None,  # the GPU's figures need the side's throughput windows (diff.attach_gpu)
    )


def _admission(con: duckdb.DuckDBPyConnection, params: SliceParams) -> Admission:
    """What admission control refused, by team and reason, and what each team got."""
    return Admission(
        rejections=[
            Rejection(team=team, reason=reason, n=n)
            for team, reason, n in con.execute(sql.SLICE_REJECTIONS, params).fetchall()
        ],
        teams=[reads.picked(Team, t) for t in reads.rows(con.execute(sql.SLICE_TEAMS, params))],
    )


def run_meta(run: RunRow, models: str | None, cold_start: dict[str, Any] | None) -> RunMeta:
    """What the `runs` row says about the server and the workload, and its server's start-up
    (`coldstart.cold_start_of`)."""
    notes = run["notes"] or {}
    return RunMeta(
        target=run["target"],
        model=run["model"] or models,
        vllm_version=run["vllm_version"],
        started_at=iso_or_none(run["started_at"]),
        ended_at=iso_or_none(run["ended_at"]),
        status=run["status"],
        workload=run["workload"],
        memory_peak_gb=notes.get("memory_peak_gb"),
        server_ready_s=notes.get("server_ready_s"),
        kv_cache=notes.get("kv_cache"),
        notes=notes,
        cold_start=cold_start,
    )
