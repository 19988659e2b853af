"""The vLLM serving dashboard: the five core indicators first (TTFT, TPOT/ITL, queue time and
depth, prefix-cache hit ratio, error rate), then throughput, latency detail, KV cache and
preemptions, prompt/generation length heatmaps, speculative decoding (draft acceptance), and the
GPU under it (dcgm-exporter's series: power, utilisation, memory, energy per token). Metric
names are vLLM's (0.32, V1 engine) and dcgm-exporter's.
preemptions, prompt/generation length heatmaps, speculative decoding (draft acceptance), and a
fleet row: each replica (`instance`) on its own line, and the skew across replicas. Every panel
follows the `model_name` and `instance` variables. Metric names are vLLM's (0.32, V1 engine).
"""

from __future__ import annotations

from grafanalib.core import Dashboard

from servescope.dashboards.panels import (
    RATE,
    TOKENS_PER_SECOND,
    Query,
    dashboard,
    heatmap,
    label_variable,
    quantile,
    row,
    timeseries,
)

UID = "servescope-vllm"
MODEL = 'model_name=~"$model_name", instance=~"$instance"'
BY_REPLICA = "model_name, instance"
ERROR_REASONS = 'finished_reason=~"error|abort"'


def _rate(metric: str, by: str = "model_name", selector: str = MODEL) -> str:
    return f"sum by ({by}) (rate({metric}{{{selector}}}[{RATE}]))"


def _quantile(q: float, bucket: str, label: str = "") -> Query:
    """A quantile of one of vLLM's histograms by model, its legend `[label] pNN <model>`."""
    legend = " ".join(part for part in (label, f"p{round(q * 100)}", "{{model_name}}") if part)
    return Query(quantile(q, bucket, "model_name", MODEL), legend)


def _percentiles(bucket: str, qs: tuple[float, ...] = (0.5, 0.95, 0.99)) -> list[Query]:
    return [_quantile(q, bucket) for q in qs]


def core_indicators() -> list:
    """The five core indicators' row. A declarative table of panels (a list of definitions,
    no logic), long by nature, as the house rules allow."""
    return [
        row("Five core indicators"),
        timeseries(
            "TTFT p50 / p95 / p99 by model",
            "Time to first token, from vLLM's arrival to the first output token. Bad: a rising "
            "p95/p99 means long prefills are blocking the queue (try chunked prefill, prefix "
            "caching or admission limits). Buckets start at 1 ms; a line flat at a bucket edge "
            "means the rank fell in the next bucket.",
            "s",
            _percentiles("vllm:time_to_first_token_seconds_bucket"),
        ),
        timeseries(
            "TPOT and ITL p95 by model",
            "Time per output token (per request: (e2e - TTFT) / (tokens - 1)) and inter-token "
            "latency (every gap between tokens). Bad: high values mean slow decode steps - "
            "too many sequences batched, preemptions, or low decode utilisation.",
            "s",
            [
                _quantile(0.95, "vllm:request_time_per_output_token_seconds_bucket", "TPOT"),
                _quantile(0.95, "vllm:inter_token_latency_seconds_bucket", "ITL"),
            ],
        ),
        timeseries(
            "Queue time p95 by model",
            "Time a request waited in vLLM's scheduler queue before its first schedule. Bad: "
            "growing queue time means excess concurrency or missing admission control.",
            "s",
            [
                _quantile(0.95, "vllm:request_queue_time_seconds_bucket", "queue"),
                _quantile(0.5, "vllm:request_queue_time_seconds_bucket", "queue"),
            ],
        ),
        timeseries(
            "Queue depth: running vs waiting",
            "Requests being processed vs waiting for a slot. Bad: `waiting` above zero for long "
            "means the server is saturated (max_num_seqs or KV cache is the limit); a growing "
            "waiting line means admission control is missing.",
            "short",
            [
                Query(
                    f"sum by (model_name) (vllm:num_requests_running{{{MODEL}}})",
                    "running {{model_name}}",
                ),
                Query(
                    f"sum by (model_name) (vllm:num_requests_waiting{{{MODEL}}})",
                    "waiting {{model_name}}",
                ),
            ],
        ),
        timeseries(
            "Prefix-cache hit ratio",
            "Share of prompt tokens served from the prefix cache (hit tokens / queried tokens). "
            "Bad: a ratio near 0 on a workload with a shared prefix means the prompt assembly "
            "differs each turn (a timestamp or reordered context at the start) or prefix "
            "caching is off.",
            "percentunit",
            [
                # The seed's query uses vllm:cache_hit_tokens_total / vllm:prompt_tokens_total;
                # vLLM exports neither ratio pair under those names. The real counters are
                # vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total (both tokens).
                Query(
                    f"{_rate('vllm:prefix_cache_hits_total')} / "
                    f"{_rate('vllm:prefix_cache_queries_total')}",
                    "hit ratio {{model_name}}",
                ),
            ],
            max_value=1,
        ),
        timeseries(
            "Error rate: finished requests by reason, and rejections",
            "Requests finished per second by vLLM's finished_reason (stop/length are normal; "
            "error and abort are failures), requests vLLM refused at admission, and requests "
            "the servescope gateway rejected by reason. Bad: any error/abort (max_model_len, "
            "OOM, parser failures, client timeouts); rejections are boundary protection, but a "
            "steady stream means a team is over its limits.",
            "reqps",
            [
                Query(
                    _rate("vllm:request_success_total", "model_name, finished_reason"),
                    "{{finished_reason}} {{model_name}}",
                ),
                Query(
                    _rate("vllm:admission_rejections_total", "model_name, reason"),
                    "vLLM rejected: {{reason}} {{model_name}}",
                ),
                Query(
                    f"sum by (team, reason) (rate(admission_rejected_total[{RATE}]))",
                    "gateway rejected: {{team}} {{reason}}",
                ),
            ],
            stacked=True,
        ),
        timeseries(
            "Error ratio",
            "Failed (finished_reason error or abort) over all finished requests. Bad: anything "
            "above the SLO's error budget; an overloaded server that fails looks faster in the "
            "latency panels, so read this next to them.",
            "percentunit",
            [
                Query(
                    f"{_rate('vllm:request_success_total', selector=f'{MODEL}, {ERROR_REASONS}')}"
                    f" / {_rate('vllm:request_success_total')}",
                    "error ratio {{model_name}}",
                ),
            ],
            max_value=1,
        ),
    ]


def throughput_and_latency() -> list:
    return [
        row("Throughput and latency detail"),
        timeseries(
            "Token throughput: prompt and generation tokens/s",
            "Prompt tokens prefilled and tokens generated per second. Bad: generation "
            "throughput flat or falling while requests wait means poor batching or memory "
            "fragmentation; throughput alone is a trap, read it next to TTFT and queue time.",
            TOKENS_PER_SECOND,
            [
                Query(_rate("vllm:prompt_tokens_total"), "prompt {{model_name}}"),
                Query(_rate("vllm:generation_tokens_total"), "generation {{model_name}}"),
            ],
        ),
        timeseries(
            "Requests per second",
            "Finished requests per second, all reasons. Bad: below the offered load while the "
            "waiting queue grows: the server cannot keep up.",
            "reqps",
            [Query(_rate("vllm:request_success_total"), "{{model_name}}")],
        ),
        timeseries(
            "End-to-end latency p50 / p95 / p99",
            "Request latency inside vLLM, arrival to last token. Bad: a p99 far above p50 means "
            "head-of-line blocking or preemptions; the smallest bucket is 0.3 s.",
            "s",
            _percentiles("vllm:e2e_request_latency_seconds_bucket"),
        ),
        timeseries(
            "Prefill and decode time p95",
            "Prefill = scheduled to first token; decode = first to last token. Bad: prefill "
            "growing with the same prompt sizes means the prefix cache stopped hitting; decode "
            "growing means larger batches or preemptions.",
            "s",
            [
                _quantile(0.95, "vllm:request_prefill_time_seconds_bucket", "prefill"),
                _quantile(0.95, "vllm:request_decode_time_seconds_bucket", "decode"),
            ],
        ),
    ]


def memory_and_lengths() -> list:
    return [
        row("KV cache, preemptions, request lengths"),
        timeseries(
            "KV-cache usage",
            "Share of KV-cache blocks in use. Bad: above 90 % new sequences wait and running "
            "ones get preempted; lower max_num_seqs or max_model_len, or add memory.",
            "percentunit",
            [Query(f"max by (model_name) (vllm:kv_cache_usage_perc{{{MODEL}}})", "{{model_name}}")],
            max_value=1,
        ),
        timeseries(
            "Preemptions per second",
            "Sequences evicted from the KV cache to make room (recomputed later). Bad: any "
            "sustained value - the KV cache is too small for the concurrency; TPOT and e2e "
            "latency suffer.",
            "ops",
            [Query(_rate("vllm:num_preemptions_total"), "{{model_name}}")],
        ),
        heatmap(
            "Prompt length heatmap",
            "Prompt tokens per request, bucketed. Bad: a shift to long prompts explains TTFT "
            "and KV-cache growth; prompts near max_model_len end in errors.",
            "short",
            f"sum by (le) (increase(vllm:request_prompt_tokens_bucket{{{MODEL}}}[{RATE}]))",
        ),
        heatmap(
            "Generation length heatmap",
            "Generated tokens per request, bucketed. Bad: everything at max_tokens means "
            "outputs are cut (finished_reason length) or EOS is ignored.",
            "short",
            f"sum by (le) (increase(vllm:request_generation_tokens_bucket{{{MODEL}}}[{RATE}]))",
        ),
    ]


SPEC = "vllm:spec_decode_num_"


def speculative_decoding() -> list:
    """Draft acceptance: what the seeds' row "speculative decoding disappoints" asks for. The
    series exist only on servers started with `--speculative-config`; elsewhere these panels
    stay empty."""
    return [
        row("Speculative decoding"),
        timeseries(
            "Draft acceptance rate",
            "Accepted draft tokens / proposed draft tokens (speculative decoding). Bad: a low or "
            "falling rate means drafts are verified and thrown away - every decode step pays for "
            "k extra tokens and TPOT gets worse, not better; lower num_speculative_tokens, pick "
            "a draft method that fits the traffic (n-gram needs outputs that repeat the prompt), "
            "or turn speculation off. Compare with TPOT before/after the flip.",
            "percentunit",
            [
                Query(
                    f"{_rate(SPEC + 'accepted_tokens_total')} "
                    f"/ {_rate(SPEC + 'draft_tokens_total')}",
                    "acceptance {{model_name}}",
                ),
                Query(
                    f"sum by (model_name, position) "
                    f"(rate({SPEC}accepted_tokens_per_pos_total{{{MODEL}}}[{RATE}])) "
                    f"/ on (model_name) group_left {_rate(SPEC + 'drafts_total')}",
                    "position {{position}} {{model_name}}",
                ),
            ],
            max_value=1,
        ),
        timeseries(
            "Accepted and proposed draft tokens/s",
            "Draft tokens the target model accepted per second (tokens speculation saved a "
            "decode step for), next to the draft tokens proposed. Bad: proposed far above "
            "accepted - speculation costs verification compute for little gain; accepted near "
            "0 while tokens are generated - the drafter finds no matches in this traffic.",
            TOKENS_PER_SECOND,
            [
                Query(_rate(SPEC + "accepted_tokens_total"), "accepted {{model_name}}"),
                Query(_rate(SPEC + "draft_tokens_total"), "proposed {{model_name}}"),
            ],
        ),
    ]


GPU = 'gpu=~"$gpu"'
ENERGY = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"  # mJ since the driver loaded (a counter)


def gpu_row() -> list:
    """The GPU under the server, from dcgm-exporter's series (`DCGM_FI_DEV_*`, the names the
    collector also stores NVML's readings under). Empty where no dcgm-exporter is scraped."""
    return [
        row("GPU (dcgm-exporter)"),
        timeseries(
            "GPU power by GPU",
            "Power draw of each GPU (DCGM_FI_DEV_POWER_USAGE). Bad: near the board's limit "
            "(about 700 W on an H100 SXM) while throughput is flat means the GPU is "
            "power-capped and its clocks drop; near idle power under load means the GPU waits "
            "on something else (CPU, network, a small batch).",
            "watt",
            [
                Query(
                    f"sum by (gpu, modelName) (DCGM_FI_DEV_POWER_USAGE{{{GPU}}})",
                    "GPU {{gpu}} {{modelName}}",
                )
            ],  # fmt: skip
        ),
        timeseries(
            "GPU and memory-copy utilisation",
            "Share of time a kernel ran (DCGM_FI_DEV_GPU_UTIL) and the memory copy engines were "
            "busy (DCGM_FI_DEV_MEM_COPY_UTIL). Bad: low GPU utilisation while requests wait "
            "means the batch is too small (raise max_num_seqs or max_num_batched_tokens) or the "
            "server is starved; pinned at 100 % with a rising queue means the GPU is the limit.",
            "percent",
            [
                Query(f"avg by (gpu) (DCGM_FI_DEV_GPU_UTIL{{{GPU}}})", "GPU util {{gpu}}"),
                Query(f"avg by (gpu) (DCGM_FI_DEV_MEM_COPY_UTIL{{{GPU}}})", "mem copy {{gpu}}"),
            ],
            max_value=100,
        ),
        timeseries(
            "GPU memory used",
            "Framebuffer memory in use per GPU (DCGM_FI_DEV_FB_USED; per MIG instance where "
            "there are any). vLLM takes gpu_memory_utilization of it at start and keeps it. "
            "Bad: a second process on the GPU (the sum above vLLM's share) - vLLM profiled "
            "less free memory and sized a smaller KV cache.",
            "mbytes",
            [Query(f"sum by (gpu) (DCGM_FI_DEV_FB_USED{{{GPU}}})", "used {{gpu}}")],
        ),
        timeseries(
            "Energy rate and joules per output token",
            "Energy used per second (the rate of the energy counter "
            "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION, mJ → J); joules per generated token of each "
            "server: the energy of the GPUs the servescope collector found that server alone "
            "using (servescope_gpu_server_info: by its processes, else its "
            "CUDA_VISIBLE_DEVICES) / that server's generation tokens rate, joined on its "
            "host:port (vLLM scraped at the address the collector reaches it); and across the "
            "selected GPUs and servers together. Bad: joules per token rising after a lever "
            "flip at the same load - the GPU does more work (or waits longer at high power) for "
            "each token; one server far above the others at the same load.",
            "short",
            [
                Query(f"sum by (gpu) (rate({ENERGY}{{{GPU}}}[{RATE}])) / 1000", "W {{gpu}}"),
                Query(_joules_per_token_by_server(), "J per output token {{server}}"),
                Query(
                    f"sum(rate({ENERGY}{{{GPU}}}[{RATE}])) / 1000 / "
                    f"sum(rate(vllm:generation_tokens_total{{{MODEL}}}[{RATE}]))",
                    "J per output token, all selected",
                ),
            ],
        ),
    ]


def _joules_per_token_by_server() -> str:
    """Per server: its own GPUs' energy rate / its generation tokens rate. A GPU is joined to
    a server through the collector's `servescope_gpu_server_info{UUID, server}`, kept only for
    a UUID that names one server (two collectors that each claim a GPU would make the join
    ambiguous); vLLM's `instance` is copied to `server` for the division."""
    owner = "max by (UUID, server) (servescope_gpu_server_info)"
    sole = f"{owner} and on (UUID) (count by (UUID) ({owner}) == 1)"
    energy = (
        f"sum by (server) (rate({ENERGY}{{{GPU}}}[{RATE}]) * on (UUID) group_left (server) "
        f"({sole})) / 1000"
    )
    tokens = (
        f"label_join(sum by (instance) (rate(vllm:generation_tokens_total{{{MODEL}}}[{RATE}])), "
        '"server", "", "instance")'
    )
    return f"{energy} / on (server) {tokens}"


def _skew(per_replica: str) -> str:
    """Standard deviation / mean across a model's replicas (0 = even; the mean floored so an
    idle fleet reads 0, not NaN)."""
    return (
        f"stddev by (model_name) ({per_replica}) / "
        f"clamp_min(avg by (model_name) ({per_replica}), 1e-9)"
    )


def fleet() -> list:
    """Several replicas of a model (a pool behind the gateway): what each replica does, and how
    unevenly - a fleet's average hides the replica that sets its tail."""
    hit_ratio = (
        f"{_rate('vllm:prefix_cache_hits_total', BY_REPLICA)} / "
        f"{_rate('vllm:prefix_cache_queries_total', BY_REPLICA)}"
    )
    running = f"sum by ({BY_REPLICA}) (vllm:num_requests_running{{{MODEL}}})"
    waiting = f"sum by ({BY_REPLICA}) (vllm:num_requests_waiting{{{MODEL}}})"
    kv = f"max by ({BY_REPLICA}) (vllm:kv_cache_usage_perc{{{MODEL}}})"
    return [
        row("Fleet: replicas of a model"),
        timeseries(
            "Prefix-cache hit ratio by replica",
            "Each replica's share of prompt tokens served from its own prefix cache. Bad: "
            "replicas far apart (one cache holds the hot prefixes, another recomputes them), or "
            "all low while the traffic shares prefixes - round-robin spreads every prefix over "
            "every replica; route by prefix (gateway `routing: prefix-affinity`).",
            "percentunit",
            [Query(hit_ratio, "{{instance}} {{model_name}}")],
            max_value=1,
        ),
        timeseries(
            "Running and waiting by replica",
            "Requests each replica runs and queues. Bad: one replica waiting while another has "
            "room - the routing does not follow load (try least-outstanding, or a lower "
            "load_factor for prefix-affinity).",
            "short",
            [
                Query(running, "running {{instance}}"),
                Query(waiting, "waiting {{instance}}"),
            ],
        ),
        timeseries(
            "KV-cache usage by replica",
            "Each replica's KV-cache usage (0-1). Bad: one replica near 1 (preemptions ahead) "
            "while others are idle.",
            "percentunit",
            [Query(kv, "{{instance}} {{model_name}}")],
            max_value=1,
        ),
        timeseries(
            "Skew across replicas (std-dev / mean)",
            "Coefficient of variation across a model's replicas, per indicator: 0 = every "
            "replica the same. Bad: above ~0.3 - the fleet is as slow as its busiest or "
            "coldest replica; servescope's diagnosis names the routing lever from the same "
            "numbers (report build: skew lines).",
            "percentunit",
            [
                Query(_skew(hit_ratio), "hit ratio {{model_name}}"),
                Query(_skew(running), "running {{model_name}}"),
                Query(_skew(waiting), "waiting {{model_name}}"),
                Query(_skew(kv), "KV usage {{model_name}}"),
            ],
        ),
    ]


def build() -> Dashboard:
    return dashboard(
        UID,
        "vLLM serving",
        "The five core indicators of a vLLM server (TTFT, TPOT/ITL, queue time, prefix-cache "
        "hit ratio, error rate), then throughput, KV cache, request lengths and speculative "
        "decoding. Lever flips are annotated on every time series.",
        [
            *core_indicators(),
            *throughput_and_latency(),
            *memory_and_lengths(),
            *speculative_decoding(),
            *gpu_row(),
            *fleet(),
        ],
        [
            label_variable("model_name", "vllm:num_requests_running", "Model"),
            label_variable("instance", "vllm:num_requests_running", "Replica"),
            label_variable("gpu", "DCGM_FI_DEV_POWER_USAGE", "GPU"),
        ],
    )
