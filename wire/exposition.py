"""Prometheus exposition text → `metric_samples` rows, with vLLM's names made current.

vLLM renamed metrics across versions (`gpu_cache_usage_perc` → `kv_cache_usage_perc`,
`gpu_prefix_cache_*` → `prefix_cache_*`), and exposition parsers differ on whether a counter
keeps its `_total` suffix. Samples are stored under vLLM 0.32's names, so a query written once
works for every server version.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime

from prometheus_client.parser import text_string_to_metric_families

LEGACY_NAMES = {
    "vllm:gpu_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "vllm:cpu_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "vllm:gpu_prefix_cache_queries": "vllm:prefix_cache_queries",
    "vllm:gpu_prefix_cache_hits": "vllm:prefix_cache_hits",
    "vllm:gpu_prefix_cache_queries_total": "vllm:prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_hits_total": "vllm:prefix_cache_hits_total",
}

# Counters vLLM exports; a sample of one of these without `_total` gets it.
COUNTERS = frozenset(
    {
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:num_preemptions",
        "vllm:request_success",
        "vllm:admission_rejections",
    }
)

Sample = tuple[datetime, str, str, dict[str, str], str | None, float]


def current_name(name: str) -> str:
    """The vLLM 0.32 name of a sample name from any vLLM version."""
    name = LEGACY_NAMES.get(name, name)
    return f"{name}_total" if name in COUNTERS else name


def parse_exposition(
    text: str, *, target: str, ts: datetime, run_id: str | None = None
) -> Iterator[Sample]:
    """Every sample of a `/metrics` page as (ts, target, name, labels, run_id, value) rows.

    Raises ValueError on text that is not Prometheus exposition format.
    """
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            yield ts, target, current_name(sample.name), dict(sample.labels), run_id, sample.value


def prefix_cache_hit_ratio(
    hits: float | None, queries: float | None, prompt_tokens: float | None
) -> tuple[float | None, str | None]:
    """(ratio, basis) of a run's prefix-cache hits, from counter deltas, in tokens.

    Δhits / Δqueries is vLLM's own ratio. With prefix caching off vLLM never queries the cache
    (Δqueries = 0) though every prompt token was computed, so the ratio is then hits over prompt
    tokens, i.e. 0 (the seeds' Panel 3), rather than undefined. None without enough samples.
    """
    if hits is not None and queries:
        return hits / queries, "queries"
    if hits is not None and prompt_tokens:
        return hits / prompt_tokens, "prompt_tokens"
    return None, None
