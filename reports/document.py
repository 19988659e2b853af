"""report.json as types: one TypedDict per part of a report, from which the published JSON Schema
(docs/report.schema.json) is generated.

TypedDicts rather than classes because a report is a document: the templates, the JSON writer and
every script that reads report.json index it by key, and a TypedDict is that dict at run time
while a type checker holds each key to its type, and a builder that writes a key twice or leaves
one out does not pass. A part another module fills with numbers of its own (the fleet's
replicas, a server's engines, the cold start) is an open object here; its module documents its
keys. The diagnosis's types are reports/diagnosed.py's. reports/schema.py publishes the schema
(docs/report.schema.json).
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

from servescope.reports.diagnosed import Diagnosis
from servescope.store.notes import KvCacheNotes, RunNotes

Kind = Literal["run", "diff", "split"]
Better = Literal["lower", "higher"]


class Percentiles(TypedDict):
    """A per-request figure over the successful requests that measured it (null: none did)."""

    p50: float | None
    p90: float | None
    p95: float | None
    p99: float | None
    mean: float | None


class Throughput(TypedDict):
    """Per second of the slice's span, first request sent to last one finished."""

    duration_s: float | None
    requests_per_s: float | None
    input_tokens_per_s: float | None
    output_tokens_per_s: float | None


class Goodput(TypedDict):
    """Requests that met every SLO (vLLM's goodput); null in a report without SLOs."""

    slo: dict[str, float]
    good_requests: int
    ratio: float | None
    requests_per_s: float | None


class ServerFigures(TypedDict, total=False):
    """vLLM's own TTFT, TPOT and e2e, beside the client's when the report shows the client's
    and the run has both."""

    server_ttft_ms: Percentiles
    server_tpot_ms: Percentiles
    server_e2e_ms: Percentiles


class Figures(ServerFigures):
    """What the whole slice and each of its load levels report alike. TTFT, TPOT and e2e come
    from the source `sources` names (`client` or `server`)."""

    requests: int
    errors: int
    error_rate: float | None
    rejected: int
    sources: dict[str, str]
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    itl_ms: Percentiles
    e2e_ms: Percentiles
    queue_ms: Percentiles
    prefill_ms: Percentiles
    decode_ms: Percentiles
    throughput: Throughput
    goodput: Goodput | None
    cache_hit_request_ratio: float | None
    cached_token_ratio: float | None
    prompt_tokens_mean: float | None
    errors_by_class: dict[str, int]


class TokenQuantiles(TypedDict):
    p50: float | None
    p95: float | None


class Shape(TypedDict):
    """What the workload looked like: token quantiles (t-digest estimates)."""

    prompt_tokens: TokenQuantiles
    output_tokens: TokenQuantiles


class OneChunkStreams(TypedDict):
    """Successful streams whose tokens all arrived in one read: they carry no client TPOT."""

    streams: int
    share: float
    tpot_source: str


class Overall(Figures):
    first_ts: str | None
    models: str | None
    shape: Shape
    one_chunk_streams: OneChunkStreams


class Group(Figures):
    """One load level: a workload at a concurrency (closed loop) or a target rate (open loop)."""

    workload: str | None
    concurrency: int | None
    target_rate: float | None


class PhaseMeans(TypedDict):
    """vLLM's mean time per phase over the slice (Δ sum / Δ count of its histograms), in ms."""

    queue: float | None
    prefill: float | None
    decode: float | None
    ttft: float | None
    e2e: float | None


class AcceptedAt(TypedDict):
    """Drafts accepted up to a position (reports/specdecode.py)."""

    position: int
    accepted: float
    rate: float | None  # accepted at the position / drafts


class SpecNumbers(TypedDict):
    """Speculative decoding over a slice, from `/metrics` deltas (reports/specdecode.py)."""

    drafts: float
    draft_tokens: float | None
    accepted_tokens: float | None
    acceptance_rate: float | None  # accepted / draft tokens
    accepted_per_draft: float | None  # accepted tokens / drafts
    per_position: list[AcceptedAt]


class SpecWorkload(SpecNumbers):
    workload: str | None


class SpecDecode(SpecNumbers):
    """A slice's speculative decoding, overall and per workload; null without speculation."""

    workloads: list[SpecWorkload]


class Server(TypedDict):
    """The slice's scraped `/metrics`: counter growth and gauge peaks (null: not scraped)."""

    prefix_cache_hit_ratio: float | None
    prefix_cache_hit_ratio_basis: str | None
    prefix_cache_hits: float | None
    prefix_cache_queries: float | None
    preemptions: float | None
    admission_rejected: float | None
    kv_cache_usage_peak: float | None
    running_peak: float | None
    waiting_peak: float | None
    phase_means_ms: PhaseMeans
    spec_decode: SpecDecode | None


class Rejection(TypedDict):
    team: str | None
    reason: str
    n: int


class Team(TypedDict):
    """What admission control did to one tenant."""

    team: str
    requests: int
    ok: int
    rejected: int
    failed: int
    queue_ms_p95: float | None
    rejected_without_reason: int


class Admission(TypedDict):
    rejections: list[Rejection]
    teams: list[Team]


class GpuFigures(TypedDict):
    """A slice's GPUs over its throughput windows (reports/gpu.py); only `measured` (false) and
    `gpus` (0) where no GPU was sampled."""

    measured: bool
    gpus: int
    gpu_ids: NotRequired[list[str]]
    devices: NotRequired[list[str]]  # product names, as the samples label them
    energy_basis: NotRequired[str | None]  # the energy counter, or power integrated
    energy_j: NotRequired[float | None]
    mean_power_w: NotRequired[float | None]
    sampled_power_w: NotRequired[float | None]
    gpu_util_pct: NotRequired[float | None]
    fb_used_mib_peak: NotRequired[float | None]
    j_per_output_token: NotRequired[float | None]
    j_per_request: NotRequired[float | None]


class Summary(TypedDict):
    """One slice's numbers (reports/summary.py); `gpu` is reports/gpu.py's."""

    overall: Overall
    groups: list[Group]
    server: Server
    admission: Admission
    gpu: GpuFigures | None


class RunMeta(TypedDict):
    """What the `runs` row says about the server and the workload."""

    target: str | None
    model: str | None
    vllm_version: str | None
    started_at: str | None
    ended_at: str | None
    status: str | None
    workload: dict[str, Any] | None  # the workload spec as run (loadgen/workload.py)
    memory_peak_gb: float | None
    server_ready_s: float | None
    kv_cache: KvCacheNotes | None
    notes: RunNotes  # what the run's producer noted
    cold_start: dict[str, Any] | None  # reports/coldstart.py


class Window(TypedDict):
    """The part of a run a report covers (`--since`/`--until`), UTC."""

    since: str | None
    until: str | None


class Flip(TypedDict):
    """A `lever_flips` row inside the report's span."""

    ts: str
    t: float
    lever: str
    before: str | None
    after: str | None
    note: str | None
    run_id: str | None


class ChecklistItem(TypedDict):
    item: str
    criterion: str
    status: str  # pass | fail | not measured | not measurable here
    evidence: str


class LeverChange(TypedDict):
    lever: str
    before: Any
    after: Any


class RowTest(TypedDict):
    """How a diff row was tested: on the runs' values (`repeats`) or per-request draws."""

    method: str
    scale: str
    df: int | None
    spread: float | None
    covers: str
    request_share: NotRequired[float | None]  # of one run's variance (repeats): sizes runs


class RowRepeats(TypedDict):
    """Each run's own value, per arm."""

    before: list[float | None]
    after: list[float | None]


class DiffRow(TypedDict):
    """One indicator at one load level, before against after (docs/verdicts.md)."""

    metric: str
    level: str
    source: str | None
    better: Better
    before: float | None
    after: float | None
    delta: float | None
    delta_pct: float | None
    ci95: list[float] | None
    ci95_pct: list[float] | None
    verdict: str
    test: RowTest | None
    p_value: float | None
    p_adjusted: NotRequired[float]  # rows of the family
    confidence: NotRequired[float]  # the level `ci95` is read at (the primary's: the rule's)
    too_few: NotRequired[str]  # why no interval could be formed ("12 requests; p99 needs 300")
    role: str | None
    detectable: float | None
    detectable_pct: float | None
    repeats: RowRepeats


class Primary(TypedDict):
    """The indicator the flip is judged by and the family the other rows are corrected as."""

    metric: str
    level: str
    asked: str
    alpha: float
    family_alpha: float
    family: int
    correction: str
    why: str


class Decision(TypedDict):
    """The primary indicator's verdict under the stopping rule (docs/verdicts.md): the interval
    it reads is a repeated confidence interval, valid however many looks the experiment took.

    `verdict`: improved or regressed (the interval excludes no change), unchanged (the interval
    lies within ±`margin_pct`), undecided (neither), not tested. `stopped`: why the experiment
    stopped ("decided", "budget", "max repeats", "interrupted"), null for a comparison of stored
    runs. `more_repeats`: for undecided, about how many more repeats a side would decide (null:
    unknown, or more than the cap)."""

    metric: str
    level: str
    verdict: str
    before: float | None
    after: float | None
    estimate_pct: float | None
    interval_pct: list[float] | None
    interval: list[float] | None
    confidence: float
    margin_pct: float
    look: int
    plan: list[int]
    stopped: str | None
    more_repeats: int | None
    reason: str
    words: str


class PowerLine(TypedDict):
    change_pct: float
    repeats_a_side: int | None


class Power(TypedDict):
    """What the design detects on the primary row, and the repeats that would find more."""

    metric: str
    level: str
    detectable_pct: float | None
    detectable: float | None
    repeats_for: list[PowerLine]
    known: bool
    cap: int


class Design(TypedDict):
    """How many runs each arm had and what the intervals cover; `before_arm` and `after_arm`
    name the arms as people say them (an experiment's arm, else the first run's id)."""

    before: int
    after: int
    before_arm: str
    after_arm: str
    before_runs: list[str]
    after_runs: list[str]
    covers: str
    note: str | None


class RepeatState(TypedDict):
    """How a repeat started, as the experiment noted it."""

    run_id: str
    repeat_state: str | None
    repeat_design: str | None


class RepeatStates(TypedDict):
    before: list[RepeatState]
    after: list[RepeatState]


class Bootstrap(TypedDict):
    draws: int
    seed: int
    method: str


class SpecWorkloadDiff(TypedDict):
    """One workload of a diff's speculative-decoding section: acceptance on each side next to
    TPOT p50 (tested as the diff's rows are) and ITL p50."""

    workload: str | None
    acceptance_before: float | None
    acceptance_after: float | None
    accepted_per_draft_after: float | None
    tpot_ms_p50_before: float | None
    tpot_ms_p50_after: float | None
    tpot_ms_p50_change_pct: float | None
    tpot_ms_p50_ci95_pct: list[float] | None
    tpot_verdict: str
    itl_ms_p50_before: float | None
    itl_ms_p50_after: float | None
    itl_ms_p50_change_pct: float | None


class SpecDecodeDiff(TypedDict):
    """A diff's speculative decoding (reports/specdecode.py): null when neither side ran it."""

    on_before: bool
    on_after: bool
    acceptance_before: float | None
    acceptance_after: float | None
    tpot: list[DiffRow]  # the diff's own TPOT rows
    itl_ms_p50_before: float | None
    itl_ms_p50_after: float | None
    workloads: list[SpecWorkloadDiff]


class ReplicaEnergy(TypedDict):
    """A replica's own GPUs over a fleet slice's span (`measured` false: none of its own)."""

    measured: bool
    sessions: list[str]  # the server sessions it ran as
    gpus: NotRequired[int]
    gpu_ids: NotRequired[list[str]]
    energy_basis: NotRequired[str | None]
    energy_j: NotRequired[float]
    mean_power_w: NotRequired[float]
    j_per_output_token: NotRequired[float | None]
    j_per_request: NotRequired[float | None]


class ReplicaRow(TypedDict):
    """One replica of a fleet run (reports/replicas.py), its events joined with its server's
    numbers by its URL; `replica` null: the requests that reached none."""

    replica: str | None
    url: str | None
    requests: int
    ok: int
    errors: int
    errors_by_class: dict[str, int]
    route_reasons: dict[str, int]
    ttft_ms_p50: float | None
    ttft_ms_p95: float | None
    cached_token_ratio: float | None
    queue_ms_p95: float | None
    server_ttft_ms_p95: float | None
    prefill_ms_p95: float | None
    decode_ms_p95: float | None
    prefix_cache_hit_ratio: float | None
    prefix_cache_hits: float | None
    prefix_cache_queries: float | None
    kv_cache_usage_peak: float | None
    running_peak: float | None
    waiting_peak: float | None
    preemptions: float | None
    server_requests_finished: float | None
    scraped: bool
    gpu: NotRequired[ReplicaEnergy | None]  # its own GPUs (reports written since they were)
    j_per_output_token: NotRequired[float | None]


class Spread(TypedDict):
    """One indicator across the replicas (or engines) that measured it; `min` when one did."""

    n: int
    max: float | None
    min: NotRequired[float]
    mean: float | None
    max_over_mean: float | None
    cv: float | None  # coefficient of variation (population)


class Change(TypedDict):
    before: float | None
    after: float | None
    delta: float | None


class ReplicaChange(TypedDict):
    """A replica's change in a diff, per indicator of reports/replicas.py's INDICATORS."""

    replica: str | None
    requests: Change
    ttft_ms_p50: Change
    ttft_ms_p95: Change
    queue_ms_p95: Change
    prefix_cache_hit_ratio: Change
    kv_cache_usage_peak: Change
    preemptions: Change
    errors: Change
    j_per_output_token: NotRequired[Change]  # reports written since replicas' energy


class ReplicasServer(TypedDict):
    """Where a fleet's replica server numbers came from: servescope's own scrapes, or a
    Prometheus (`report build --prometheus`), with what was asked of it."""

    source: str  # "servescope scrapes" | "prometheus"
    url: NotRequired[str]
    instances: NotRequired[dict[str, str]]  # replica → Prometheus instance
    since: NotRequired[str]
    until: NotRequired[str]
    range: NotRequired[str]
    evaluated_at: NotRequired[str]


class Fleet(TypedDict):
    """A fleet run's replicas (reports/replicas.py): null for a run of one server."""

    replicas: list[ReplicaRow] | None
    skew: dict[str, Spread] | None
    replicas_server: ReplicasServer | None


class Numbers(Summary, Fleet):
    """A slice's numbers as a report shows them; `engines`: a data-parallel server's engines
    and GPUs (reports/engines.py), null for a server of one engine on one GPU."""

    engines: dict[str, Any] | None


class SideReport(Numbers):
    """One arm of a comparison, as its first run reports it."""

    name: str
    run_id: str
    levers: dict[str, Any]
    run: RunMeta


class Compared(TypedDict, total=False):
    """What a diff (`--vs`) and a split (`--split-at-flip`) add to a report."""

    headline: str
    lever_changes: list[LeverChange]
    warnings: list[str]
    before: SideReport
    after: SideReport
    diff: list[DiffRow]
    primary: Primary
    decision: Decision
    repeats: Design
    repeat_states: RepeatStates
    power: Power | None
    replicas_diff: list[ReplicaChange] | None
    spec_decode: SpecDecodeDiff | None  # reports/specdecode.py; null without speculation
    bootstrap: Bootstrap


class Report(Numbers, Compared):
    """report.json. A run's report, and a diff's or a split's with the keys of `Compared`;
    their top-level numbers are the after side's (a split's: the whole run's). `charts` (inline
    SVG) is the HTML's and never in report.json."""

    report_id: str
    kind: Kind
    run_id: str
    window: NotRequired[Window | None]  # a run's and a diff's (after side)
    base_run_id: NotRequired[str]
    base_window: NotRequired[Window | None]
    split_at: NotRequired[str]
    levers: dict[str, Any]
    run: RunMeta
    slo: dict[str, float] | None
    checklist: list[ChecklistItem]
    flips: list[Flip]
    cold_start: list[dict[str, Any]]  # reports/coldstart.py: a run's phases, a diff's changes
    diagnosis: Diagnosis
    charts: NotRequired[dict[str, str]]
