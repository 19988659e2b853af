"""The readings the diagnosis takes of a run: every indicator its rules read
(reports/diagnosis.yaml), measured from one report side — outcomes, latencies, the workload's
shape, the server's `/metrics`, a fleet's replicas — each with its label, its unit and where it
is measured (`INDICATORS`), and shown in its unit for the evidence lines. None is "not
measured", never 0."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from servescope.reports.diagnosed import IndicatorValue
from servescope.reports.document import Percentiles, SideReport


class Subject(SideReport):
    """What the rules read: one report side (a run's, or a diff's before or after) and the
    SLOs its targets come from."""

    slo: dict[str, float] | None


Values = dict[str, IndicatorValue]  # every indicator the rules read, by name


@dataclass(frozen=True)
class Indicator:
    label: str
    unit: str  # "ratio" (shown in %), "ms", "tokens", "count", "x" (a multiple), "text"
    source: str


INDICATORS: dict[str, Indicator] = {
    "requests": Indicator("requests", "count", "events"),
    "failure_rate": Indicator(
        "failure rate (rejections and 4xx excluded)", "ratio", "events: status, error class"),
    "invalid_rate": Indicator("share refused as invalid (HTTP 4xx)", "ratio", "events: http_4xx"),
    "rejection_rate": Indicator("rejection rate", "ratio", "events: status = rejected"),
    "errors_top_class": Indicator("most common error", "text", "events: error class"),
    "rejections_top_reason": Indicator(
        "most common rejection", "text", "events: rejected:<reason>"),
    "ttft_p50_ms": Indicator("TTFT p50", "ms", "events"),
    "ttft_p95_ms": Indicator("TTFT p95", "ms", "events"),
    "tpot_p95_ms": Indicator("TPOT p95", "ms", "events"),
    "itl_p50_ms": Indicator("ITL p50", "ms", "events: chunk gaps"),
    "itl_p99_ms": Indicator("ITL p99", "ms", "events: chunk gaps"),
    "tpot_p50_ms": Indicator("TPOT p50", "ms", "events"),
    "itl_jitter": Indicator(
        "ITL p99 / TPOT p50", "x",
        "events: the slowest chunk gaps against the typical per-token time (chunk gaps "
        "themselves are often 0: several tokens arrive in one read)"),
    "ttft_spread": Indicator("TTFT p95 / p50", "x", "events"),
    "queue_share_of_ttft": Indicator(
        "queue share of TTFT", "ratio",
        "mean queue_ms / mean ttft_ms (traces), else vLLM's queue/TTFT histograms"),
    "prefill_share_of_ttft": Indicator(
        "prefill share of TTFT", "ratio",
        "mean prefill_ms / mean ttft_ms (traces), else vLLM's prefill/TTFT histograms"),
    "decode_share_of_e2e": Indicator(
        "decode share of e2e", "ratio",
        "mean decode_ms / mean e2e_ms (traces), else vLLM's decode/e2e histograms"),
    "prompt_tokens_p50": Indicator("prompt tokens p50", "tokens", "events"),
    "prompt_tokens_p95": Indicator("prompt tokens p95", "tokens", "events"),
    "output_tokens_p50": Indicator("output tokens p50", "tokens", "events"),
    "output_tokens_p95": Indicator("output tokens p95", "tokens", "events"),
    "prompt_spread": Indicator("prompt tokens p95 / p50", "x", "events"),
    "output_to_prompt": Indicator("output / prompt tokens (p50)", "x", "events"),
    "shared_prefix_share": Indicator(
        "shared-prefix share of the prompt", "ratio", "workload spec: prefix_tokens / prompt"),
    "prefix_cache_hit_ratio": Indicator(
        "prefix-cache hit ratio", "ratio",
        "server Δhits/Δqueries, else client cached/prompt tokens"),
    "cached_token_ratio": Indicator("cached / prompt tokens (client)", "ratio", "events: usage"),
    "spec_draft_tokens": Indicator(
        "speculative draft tokens", "count",
        "Δ vllm:spec_decode_num_draft_tokens_total (0 when /metrics was scraped and shows none)"),
    "spec_acceptance_rate": Indicator(
        "draft acceptance rate", "ratio",
        "Δ vllm:spec_decode_num_accepted_tokens_total / Δ …_num_draft_tokens_total"),
    "spec_accepted_per_draft": Indicator(
        "accepted tokens per draft", "x",
        "Δ accepted tokens / Δ vllm:spec_decode_num_drafts_total"),
    "kv_cache_usage_peak": Indicator("KV-cache usage peak", "ratio", "vllm:kv_cache_usage_perc"),
    "preemptions": Indicator("preemptions", "count", "Δ vllm:num_preemptions_total"),
    "waiting_peak": Indicator("waiting peak", "count", "vllm:num_requests_waiting"),
    "running_peak": Indicator("running peak", "count", "vllm:num_requests_running"),
    "concurrency_max": Indicator("concurrency", "count", "workload levels"),
    "turns_max": Indicator("turns per session", "count", "workload spec: turns"),
    "workload_classes": Indicator("request classes", "count", "workload spec"),
    "chat_share": Indicator("chat-endpoint share of workloads", "ratio", "workload spec"),
    "replicas": Indicator(
        "replicas that served requests", "count", "events: upstream (1: a run of one server)"),
    "replica_load_skew": Indicator(
        "requests on the busiest replica / the mean", "x", "events: upstream"),
    "replica_hit_ratio_cv": Indicator(
        "prefix-cache hit ratio's coefficient of variation across replicas", "ratio",
        "each replica's Δ vllm:prefix_cache_hits / Δ queries"),
    "replica_hit_ratio_range": Indicator(
        "prefix-cache hit ratio, lowest → highest replica", "text",
        "each replica's Δ vllm:prefix_cache_hits / Δ queries"),
    "prefix_hit_gap": Indicator(
        "shared-prefix share of the prompt not served from the prefix cache", "ratio",
        "workload spec − the fleet's Δ hits / Δ queries"),
}  # fmt: skip


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def _tokens_mean(spec: Any) -> float | None:
    """The mean of a workload's token spec: a number, or {dist, min, max, mean}."""
    if isinstance(spec, int | float) and not isinstance(spec, bool):
        return float(spec)
    if isinstance(spec, dict):
        if spec.get("mean") is not None:
            return float(spec["mean"])
        if spec.get("min") is not None and spec.get("max") is not None:
            return (float(spec["min"]) + float(spec["max"])) / 2
    return None


def _prefix_share(workloads: Sequence[Mapping[str, Any]]) -> float | None:
    """Mean over the spec's workloads of prefix / (prefix + rest of the prompt)."""
    shares = []
    for w in workloads:
        prefix = _tokens_mean(w.get("prefix_tokens")) or 0.0
        classes = [c for c in w.get("classes") or [] if isinstance(c, dict)]
        inputs = [_tokens_mean(c.get("input_tokens")) for c in classes] or [
            _tokens_mean(w.get("input_tokens"))
        ]
        rest = [x for x in inputs if x is not None]
        if rest:
            body = sum(rest) / len(rest)
            shares.append(prefix / (prefix + body) if prefix + body else 0.0)
    return sum(shares) / len(shares) if shares else None


def _phase_share(
    part: Percentiles, whole: Percentiles, server_part: float | None, server_whole: float | None
) -> float | None:
    """A phase's share of a whole, from per-request traces' means, else vLLM's histograms'."""
    traced = _ratio(part["mean"], whole["mean"])
    return traced if traced is not None else _ratio(server_part, server_whole)


def indicators(report: Subject) -> Values:
    """Every indicator the rules read, measured from one report (side); None = not measured."""
    overall = report["overall"]
    values: Values = {
        **_outcomes(report),
        "ttft_p50_ms": overall["ttft_ms"]["p50"],
        "ttft_p95_ms": overall["ttft_ms"]["p95"],
        "tpot_p95_ms": overall["tpot_ms"]["p95"],
        "itl_p50_ms": overall["itl_ms"]["p50"],
        "itl_p99_ms": overall["itl_ms"]["p99"],
        "tpot_p50_ms": overall["tpot_ms"]["p50"],
        "itl_jitter": _ratio(overall["itl_ms"]["p99"], overall["tpot_ms"]["p50"]),
        "ttft_spread": _ratio(overall["ttft_ms"]["p95"], overall["ttft_ms"]["p50"]),
        **_shape(report),
        **_server(report),
    }
    values.update(_fleet(report, values))
    return values


def _outcomes(report: Subject) -> Values:
    """How the requests ended: failures, invalid requests, rejections and their commonest
    reasons."""
    overall = report["overall"]
    requests = overall["requests"]
    classes = {k: v for k, v in overall["errors_by_class"].items() if not k.startswith("rejected")}
    # a 4xx is a request the server refused as sent (a client's mistake, or over the context
    # limit): no server lever makes it succeed but max_model_len, so it is a symptom of its own
    invalid = classes.get("http_4xx", 0)
    failed = overall["errors"] - overall["rejected"] - invalid
    reasons = report["admission"]["rejections"]
    return {
        "requests": requests,
        "failure_rate": _ratio(failed, requests),
        "invalid_rate": _ratio(invalid, requests),
        "rejection_rate": _ratio(overall["rejected"], requests),
        "errors_top_class": max(classes, key=classes.__getitem__) if classes else None,
        "rejections_top_reason": max(reasons, key=lambda r: r["n"])["reason"] if reasons else None,
    }


def _shape(report: Subject) -> Values:
    """The workload's shape: token sizes, shared prefixes, turns, classes, endpoints."""
    shape = report["overall"]["shape"]
    prompt, output = shape["prompt_tokens"], shape["output_tokens"]
    spec = report["run"]["workload"] or {}
    workloads = [w for w in spec.get("workloads") or [] if isinstance(w, dict)]
    levels = [g["concurrency"] for g in report["groups"] if g["concurrency"]]
    return {
        "prompt_tokens_p50": prompt["p50"],
        "prompt_tokens_p95": prompt["p95"],
        "output_tokens_p50": output["p50"],
        "output_tokens_p95": output["p95"],
        "prompt_spread": _ratio(prompt["p95"], prompt["p50"]),
        "output_to_prompt": _ratio(output["p50"], prompt["p50"]),
        "shared_prefix_share": _prefix_share(workloads),
        "concurrency_max": max(levels) if levels else None,
        "turns_max": max((int(w.get("turns") or 1) for w in workloads), default=None),
        "workload_classes": sum(len(w.get("classes") or []) for w in workloads)
        if workloads
        else None,
        "chat_share": _ratio(sum(w.get("endpoint") == "chat" for w in workloads), len(workloads)),
    }


def _server(report: Subject) -> Values:
    """What the server's `/metrics` said: phases, prefix-cache hits, speculation, memory,
    queues."""
    overall, server = report["overall"], report["server"]
    means = server["phase_means_ms"]
    hit = server["prefix_cache_hit_ratio"]
    spec = server["spec_decode"]
    scraped = server["prefix_cache_queries"] is not None  # /metrics was read for the slice
    return {
        "queue_share_of_ttft": _phase_share(
            overall["queue_ms"], overall["ttft_ms"], means["queue"], means["ttft"]
        ),
        "prefill_share_of_ttft": _phase_share(
            overall["prefill_ms"], overall["ttft_ms"], means["prefill"], means["ttft"]
        ),
        "decode_share_of_e2e": _phase_share(
            overall["decode_ms"], overall["e2e_ms"], means["decode"], means["e2e"]
        ),
        "prefix_cache_hit_ratio": hit if hit is not None else overall["cached_token_ratio"],
        "cached_token_ratio": overall["cached_token_ratio"],
        "spec_draft_tokens": spec["draft_tokens"] if spec else (0 if scraped else None),
        "spec_acceptance_rate": spec["acceptance_rate"] if spec else None,
        "spec_accepted_per_draft": spec["accepted_per_draft"] if spec else None,
        "kv_cache_usage_peak": server["kv_cache_usage_peak"],
        "preemptions": server["preemptions"],
        "waiting_peak": server["waiting_peak"],
        "running_peak": server["running_peak"],
    }


def _fleet(report: Subject, values: Values) -> Values:
    """The fleet indicators (reports/replicas.py): None for a run of one server."""
    rows = [r for r in report["replicas"] or [] if r.get("replica") is not None]
    skew = report["skew"] or {}
    served = [r for r in rows if r.get("requests")]
    ratios = [r for row in rows if (r := row["prefix_cache_hit_ratio"]) is not None]
    hit, shared = values.get("prefix_cache_hit_ratio"), values.get("shared_prefix_share")
    gap = None
    if rows and isinstance(hit, float | int) and isinstance(shared, float | int):
        gap = max(0.0, shared - hit)
    load, hits = skew.get("requests"), skew.get("prefix_cache_hit_ratio")
    return {
        "replicas": len(served) if rows else 1,
        "replica_load_skew": load["max_over_mean"] if rows and load else None,
        "replica_hit_ratio_cv": hits["cv"] if len(ratios) >= 2 and hits else None,
        "replica_hit_ratio_range": f"{min(ratios) * 100:.1f} % → {max(ratios) * 100:.1f} %"
        if len(ratios) >= 2 else None,
        "prefix_hit_gap": gap,
    }  # fmt: skip


def show(name: str, value: IndicatorValue | bool | float) -> str:
    """An indicator's value in its unit, for evidence lines."""
    if value is None:
        return "not measured"
    unit = INDICATORS[name].unit if name in INDICATORS else ""
    if isinstance(value, int | float):
        number = float(value)
        if unit == "ratio":
            return f"{number * 100:.1f} %"
        if unit == "ms":
            return f"{number:,.1f} ms"
        if unit == "x":
            return f"{number:.1f}×"
        if unit in ("tokens", "count"):
            return f"{number:,.0f}"
        if isinstance(value, float):
            return f"{value:,.0f}" if value == int(value) else f"{value:,.2f}"
    return str(value)
