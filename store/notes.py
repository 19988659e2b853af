"""What a run's `notes` hold (`runs.notes`, JSON): the one description of its keys.

Three producers write notes: `bench run` (loadgen/runner.py; an experiment's runs add theirs,
loadgen/experiment.py and loadgen/fleet.py), and the collector for a server session's run
(collector/sessions.py). Every key is optional: a run has the keys of its producer, an older
store fewer, and a run imported from a file none. The store decodes the JSON once
(`store.reads`); readers use these types, never the text.
"""

from __future__ import annotations

from typing import Literal, NotRequired, TypedDict

SESSION_KIND = "vllm-session"  # `kind` of a server session's run (collector/sessions.py)


class KvStatement(TypedDict, total=False):
    """vLLM's start-up statement of its KV cache (`wire.kv_statement`)."""

    kv_cache_device: str  # where vLLM put the cache: `CPU`, `GPU`, `CPU + host`…
    kv_cache_tokens: int  # tokens the cache holds
    max_model_len: int  # the request length the concurrency is stated for
    max_concurrency: float  # requests of that length the cache holds at once


class EngineNotes(TypedDict, total=False):
    """One data-parallel engine of a server session."""

    kv_cache: KvStatement  # the engine's own KV statement (each engine sizes its cache)


class KvCacheNotes(TypedDict):
    """vLLM's statement next to servescope's arithmetic (`loadgen.capacity`); either None
    when unknown (the collector has no model folder to do the arithmetic)."""

    vllm: KvStatement | None
    servescope: dict[str, float | int | str | None] | None


class ServerNotes(TypedDict, total=False):
    """The server's `/metrics` over the run (loadgen/server_metrics.py): run-scoped deltas of
    its counters, peaks of its gauges, and how many pages were had."""

    prefix_cache_hit_ratio: float | None  # Δhits / Δqueries (or Δhits / Δprompt_tokens: basis)
    prefix_cache_hit_ratio_basis: str | None  # which denominator the ratio has
    prefix_cache_hits: float | None
    prefix_cache_queries: float | None
    preemptions: float | None
    prompt_tokens: float | None
    generation_tokens: float | None
    requests_finished: float | None
    peak_running: float | None
    peak_waiting: float | None
    kv_cache_usage_peak: float | None  # 0-1
    spec_decode_draft_tokens: float | None  # None without speculative decoding
    spec_decode_accepted_tokens: float | None
    spec_decode_acceptance_rate: float | None
    scrapes: int  # pages had
    scrape_failures: int  # pages not had, or that did not parse


class ClientNotes(TypedDict, total=False):
    """What the bench client counted over the run."""

    requests: int
    ok: int
    prompt_tokens: int
    cached_tokens: int | None  # None: the server reported no cached tokens
    cached_token_ratio: float | None
    slo: dict[str, float]  # the SLO the run was sent with: metric → ms
    good_requests: int | None  # requests that met it (None without an SLO)
    good_fraction: float | None


class ScheduleLag(TypedDict):
    """How late an open loop's sends left against their schedule, in milliseconds."""

    p50: float | None
    p99: float | None
    max: float | None


class ClassLatency(TypedDict):
    """One request class of a level: its ok requests and their latency."""

    requests: int
    ttft_ms_p50: float | None
    ttft_ms_p95: float | None
    e2e_ms_p50: float | None


class LevelNotes(TypedDict):
    """One load level of a bench run (loadgen/record.py); the open-loop keys only for an open
    loop, the goodput keys only with an SLO, `classes` only where requests have classes."""

    workload: str
    loop: str  # open | closed
    concurrency: int | None
    target_rate: float | None
    requests: int
    ok: int
    errors: int
    duration_s: float
    completed_per_s: float | None
    achieved_rate: float | None
    scheduled_rate: NotRequired[float | None]
    schedule_lag_ms: NotRequired[ScheduleLag]
    client_saturated: NotRequired[bool]
    goodput_per_s: NotRequired[float | None]
    good_fraction: NotRequired[float | None]
    classes: NotRequired[dict[str, ClassLatency]]


class ParallelNotes(TypedDict):
    """How a server spreads over GPUs, from its flags."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    gpus: int  # tensor × pipeline × data
    # --enable-expert-parallel: a mixture-of-experts model's routed experts spread whole over
    # the tensor × data parallel GPUs (present only when set)
    expert_parallel: NotRequired[bool]


class PlanNotes(TypedDict, total=False):
    """An experiment's stopping rule (`loadgen.rounds`), read again by a report of its runs."""

    first: int  # repeats a side before the first look
    last: int  # repeats a side at most
    margin_pct: float
    budget_s: float | None


class RunNotes(TypedDict, total=False):
    """A run's notes: every key optional (see the module's docstring)."""

    # -- bench run (loadgen/runner.py) ---------------------------------------------------------
    server: ServerNotes  # the server's /metrics over the run
    client: ClientNotes  # the client's counts
    levels: list[LevelNotes]  # per workload level: loop, rates, schedule lag, classes…
    errors_by_class: dict[str, int]  # failed requests by error class
    cancelled_in_flight: int  # requests cut off by Ctrl-C
    failure: str | None  # why the run failed
    scale: float  # the workload's scale
    memory_peak_gb: float | None  # the server process's peak memory (launcher's servers)
    server_ready_s: float | None  # launch to healthy (launcher's servers)
    kv_cache: KvCacheNotes | None  # vLLM's KV statement beside servescope's arithmetic
    events_file: str  # where the run's `.events.jsonl` was written
    replicas: dict[str, str]  # `--replica`: replica name → URL scraped
    slo: dict[str, float]  # an SLO noted outside `client` (older runs)
    cold_start_s: float  # a producer's measured cold start of the model
    warm_restart_s: float  # … and warm restart
    # -- an experiment's run (loadgen/experiment.py, loadgen/fleet.py) -------------------------
    experiment: str  # the experiment's name
    experiment_id: str
    profile: str  # the arm's server profile
    arm: str  # the arm's name
    repeat: int  # which repeat of the arm (1-based)
    repeats: int  # repeats a side planned
    position: int  # place in the run order (1-based)
    order: str  # the run order, e.g. `A B B A A B`
    repeat_design: str  # how servers and rounds were sequenced
    repeat_state: str  # how this run's server started it (reset, woken, fresh, warm…)
    server_runs_before: int  # runs this server served before this one
    sleep_s: float  # asleep in turn: the other arm's server going to sleep
    wake_s: float  # … and this one's waking
    plan: PlanNotes  # the stopping rule
    gateway_config: str  # the routing experiment's gateway.yaml
    # -- a server session's run (collector/sessions.py) ---------------------------------------
    kind: Literal["vllm-session"]  # SESSION_KIND
    log: str  # the log file the session was read from
    previous: str | None  # the run the same server ran before
    instance: str  # the collector's host (`collect --instance`)
    model_path: str  # the model vLLM loaded
    cache_config: dict[str, str]  # vLLM's `cache_config_info` labels
    engines: dict[str, EngineNotes]  # data-parallel rank → its own figures
    cold_start: dict[str, float]  # start-up phases (`wire.vllm_log.PHASES`): s and GiB
    parallel: ParallelNotes
    gpus: dict[str, dict[str, float]]  # `dp<E>-tp<R>` → that GPU's stated memory, GiB
