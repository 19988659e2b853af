"""From a run's indicators to the lever to flip first: vLLM's tuning tables as data.

The rules are rows of `diagnosis.yaml` (the vLLM tuning matrix, the tuning decision tree, the
workload table, split by symptom as the Serving Incident Flow does), each with its
thresholds and its source; this engine only measures indicators and checks conditions, so a rule
is audited and changed in the YAML without reading code. `diagnose(report)` reads a report dict
(`build_summary`'s, or one side of a diff) and returns the workload's shape, findings in the
rules' order (symptom, evidence with the run's numbers, levers in order, why, the experiment that
tests the first lever), recommendations withheld because the run's levers already hold them, and
what could not be judged. `assess_flip` says whether a diff's lever change moved the symptom it
was meant to move.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, NotRequired, Required, TypedDict

import yaml

from servescope.reports.document import (
    AlreadySet,
    Diagnosis,
    Finding,
    FirstFinding,
    FlipAssessment,
    HeldLever,
    IndicatorValue,
    LeverChange,
    MeasuredIndicator,
    MovedIndicator,
    NotJudged,
    OfferedLever,
    Percentiles,
    SideReport,
    WorkloadShape,
)

RULES_FILE = Path(__file__).with_name("diagnosis.yaml")
SHOWN_OPS = {">=": "≥", "<=": "≤", ">": ">", "<": "<", "==": "="}
OPS: dict[str, Callable[[Any, Any], bool]] = {
    ">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt, "==": operator.eq,
}  # fmt: skip


# -- the rules file, as types --------------------------------------------------------------------

# A condition: `indicator op value` (a value `@name` is a target), or `lever is value`
Condition = TypedDict(
    "Condition",
    {"indicator": str, "op": str, "value": float | str, "lever": str, "is": Any},
    total=False,
)


class RuleLever(TypedDict, total=False):
    """A lever of a rule, in order: the value it wants, or the way to move it."""

    lever: Required[str]
    want: Any
    direction: str
    note: str


class Rule(TypedDict):
    id: str
    symptom: str
    title: str
    when: list[Condition]
    context: NotRequired[list[str]]
    levers: list[RuleLever]
    why: str
    source: str


class ShapeRow(TypedDict, total=False):
    """A workload shape: `all` of its conditions hold, or `any`."""

    shape: Required[str]
    why: Required[str]
    all: list[Condition]
    any: list[Condition]


class LeverInfo(TypedDict, total=False):
    """What a lever is when it is no vLLM flag, and the experiment that tests it."""

    kind: str
    experiment: str


class PrimaryTable(TypedDict):
    default: str
    symptoms: dict[str, str]  # symptom → the diff metric a flip targeting it is judged by


class Rules(TypedDict):
    defaults: NotRequired[dict[str, str | int | float | bool]]  # vLLM's value of an unset lever
    primary: PrimaryTable
    targets: dict[str, float]
    rules: list[Rule]
    shapes: list[ShapeRow]
    levers: NotRequired[dict[str, LeverInfo]]


class Subject(SideReport):
    """What the rules read: one report side (a run's, or a diff's before or after) and the
    SLOs its targets come from."""

    slo: dict[str, float] | None


Values = dict[str, IndicatorValue]  # every indicator the rules read, by name
Levers = Mapping[str, object]  # a run's levers as recorded (free-form: the server's flags)


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


@cache
def load_rules(path: Path = RULES_FILE) -> Rules:
    """The rules file, checked: every condition names a known indicator and operator."""
    rules: Rules = yaml.safe_load(path.read_text())
    for rule in rules["rules"]:
        for cond in rule["when"]:
            if "lever" in cond:
                continue
            if cond["indicator"] not in INDICATORS or cond["op"] not in OPS:
                raise ValueError(f"{path}: rule {rule['id']}: bad condition {cond}")
    return rules


# -- indicators ----------------------------------------------------------------------------------


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
    ratios = [r["prefix_cache_hit_ratio"] for r in rows
              if r.get("prefix_cache_hit_ratio") is not None]  # fmt: skip
    hit, shared = values.get("prefix_cache_hit_ratio"), values.get("shared_prefix_share")
    gap = None
    if rows and isinstance(hit, float | int) and isinstance(shared, float | int):
        gap = max(0.0, shared - hit)
    return {
        "replicas": len(served) if rows else 1,
        "replica_load_skew": (skew.get("requests") or {}).get("max_over_mean") if rows else None,
        "replica_hit_ratio_cv": (skew.get("prefix_cache_hit_ratio") or {}).get("cv")
        if len(ratios) >= 2 else None,
        "replica_hit_ratio_range": f"{min(ratios) * 100:.1f} % → {max(ratios) * 100:.1f} %"
        if len(ratios) >= 2 else None,
        "prefix_hit_gap": gap,
    }  # fmt: skip


# -- conditions ----------------------------------------------------------------------------------


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


def lever_value(levers: Levers | None, name: str, defaults: Mapping[str, object]) -> object:
    """What a lever was on the run: its recorded value, vLLM's default when the run's levers were
    recorded but leave it unset, None when the run recorded no levers (unknown)."""
    if not levers:
        return None
    if name in levers:
        value = levers[name]
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        return value
    return defaults.get(name)


def holds(value: object, want: object) -> bool:
    """Does the run's lever already have the value a rule wants (`fp8` holds `fp8_e4m3`;
    `set` holds any value but off)?"""
    if value is None or want is None:
        return False
    if want == "set":
        return value not in (False, "", "None", "null")
    if isinstance(want, bool):
        return value is want
    return str(value).lower().startswith(str(want).lower())


@dataclass(frozen=True)
class _Run:
    """What a condition is checked against: the indicators, the targets, the run's levers and
    vLLM's defaults for the ones it leaves unset."""

    values: Values
    targets: Mapping[str, float]
    levers: Levers | None = None
    defaults: Mapping[str, object] = field(default_factory=dict)


def _check(cond: Condition, run: _Run) -> tuple[bool | None, str]:
    """(holds, evidence) of one condition; holds is None when it cannot be judged."""
    if "lever" in cond:
        current = lever_value(run.levers, cond["lever"], run.defaults)
        if current is None:
            return None, f"{cond['lever']} not recorded"
        return holds(current, cond["is"]), f"{cond['lever']} = {current}"
    name, threshold = cond["indicator"], cond["value"]
    if isinstance(threshold, str) and threshold.startswith("@"):
        threshold = run.targets[threshold[1:]]
    value = run.values.get(name)
    shown = show(name, threshold) if INDICATORS[name].unit != "text" else threshold
    if value is None:
        return None, f"{INDICATORS[name].label} not measured"
    ok = OPS[cond["op"]](value, threshold)
    return ok, f"{INDICATORS[name].label} {show(name, value)} ({SHOWN_OPS[cond['op']]} {shown})"


def _targets(report: Subject, rules: Rules) -> dict[str, float]:
    """The rules' targets, replaced by the run's SLOs where it has them."""
    targets = dict(rules["targets"])
    slo = report.get("slo") or {}
    for metric in ("ttft", "tpot"):
        if slo.get(f"{metric}_ms") is not None:
            targets[f"{metric}_p95_ms"] = float(slo[f"{metric}_ms"])
    return targets


# -- the engine ----------------------------------------------------------------------------------


def classify(values: Values, rules: Rules) -> WorkloadShape:
    """The workload's shape (chat / batch / rag / agent / mixed): the first `shapes` row whose
    conditions hold, with the evidence; `unclassified` when none does."""
    run = _Run(values, {})
    for row in rules["shapes"]:
        conds = row.get("all") or row.get("any") or []
        checks = [_check(c, run) for c in conds]
        verdicts = [ok for ok, _ in checks]
        matched = all(verdicts) if "all" in row else any(v is True for v in verdicts)
        if matched and verdicts:
            evidence = [text for ok, text in checks if ok]
            return WorkloadShape(shape=row["shape"], why=row["why"], evidence=evidence)
    return WorkloadShape(shape="unclassified", why="no shape's conditions held", evidence=[])


def diagnose(report: Subject, rules: Rules | None = None) -> Diagnosis:
    """Findings, withheld recommendations and unjudged rules of one report (or diff side)."""
    rules = rules or load_rules()
    values = indicators(report)
    targets = _targets(report, rules)
    if not values["requests"]:
        nothing = NotJudged(
            rule="*", symptom=None, reason="the run has no events: nothing measured"
        )
        shape = WorkloadShape(shape="unclassified", why="no requests", evidence=[])
        return _result(values, targets, shape, [], [], [nothing])
    run = _Run(values, targets, report.get("levers") or None, rules.get("defaults") or {})
    findings: list[Finding] = []
    already: list[AlreadySet] = []
    unjudged: list[NotJudged] = []
    for rule in rules["rules"]:
        checks = [_check(c, run) for c in rule["when"]]
        if any(ok is False for ok, _ in checks):
            continue
        if any(ok is None for ok, _ in checks):
            missing = "; ".join(text for ok, text in checks if ok is None)
            unjudged.append(NotJudged(rule=rule["id"], symptom=rule["symptom"], reason=missing))
            continue
        offered, held = _levers(rule, run, rules.get("levers") or {})
        if held:
            already.append(AlreadySet(rule=rule["id"], symptom=rule["symptom"], levers=held))
        if offered:
            findings.append(_finding(rule, run, [text for _, text in checks], offered))
    return _result(values, targets, classify(values, rules), findings, already, unjudged)


def _finding(rule: Rule, run: _Run, evidence: list[str], offered: list[OfferedLever]) -> Finding:
    """A rule that holds: its conditions' evidence with its context's, and the levers offered."""
    evidence += [f"{INDICATORS[n].label} {show(n, run.values.get(n))}"
                 for n in rule.get("context", []) if run.values.get(n) is not None]  # fmt: skip
    return Finding(
        rule=rule["id"],
        symptom=rule["symptom"],
        title=rule["title"],
        evidence=evidence,
        levers=offered,
        why=" ".join(rule["why"].split()),
        source=rule["source"],
        experiment=offered[0]["experiment"],
        levers_recorded=run.levers is not None,
    )


def _levers(
    rule: Rule, run: _Run, registry: Mapping[str, LeverInfo]
) -> tuple[list[OfferedLever], list[HeldLever]]:
    """The rule's levers split into those to offer and those the run already holds."""
    offered: list[OfferedLever] = []
    held: list[HeldLever] = []
    for entry in rule["levers"]:
        name = entry["lever"]
        current = lever_value(run.levers, name, run.defaults)
        if "want" in entry and holds(current, entry["want"]):
            held.append(HeldLever(lever=name, value=current, want=entry["want"]))
            continue
        info = registry.get(name) or LeverInfo()
        offered.append(
            OfferedLever(
                lever=name,
                want=entry.get("want"),
                direction=entry.get("direction"),
                current=current,
                note=entry.get("note"),
                kind=info.get("kind", "vLLM flag"),
                experiment=info.get("experiment"),
            )
        )
    return offered, held


def _result(values: Values, targets: dict[str, float], shape: WorkloadShape,
            findings: list[Finding], already: list[AlreadySet],
            unjudged: list[NotJudged]) -> Diagnosis:  # fmt: skip
    first = findings[0] if findings else None
    return Diagnosis(
        workload_shape=shape,
        first=FirstFinding(symptom=first["symptom"], lever=first["levers"][0]["lever"],
                           rule=first["rule"]) if first else None,
        findings=findings,
        already_set=already,
        not_judged=unjudged,
        indicators={k: MeasuredIndicator(value=v, label=INDICATORS[k].label,
                                         source=INDICATORS[k].source)
                    for k, v in values.items()},
        targets=targets,
        rules_file="reports/diagnosis.yaml",
    )  # fmt: skip


def _number(value: object) -> float | None:
    try:
        return float(str(value))
    except (TypeError, ValueError):
        return None


def _moves_as_wanted(entry: RuleLever | OfferedLever, before: object, after: object) -> bool | None:
    """Does a lever change go the way a finding's lever entry asks (`want` reached, `raise` /
    `lower` by number)? None when that cannot be told (an unset or non-numeric side, `fit`,
    `set`, `tune`)."""
    if entry.get("want") is not None:
        if after is None:
            return None
        return holds(lever_value({"lever": after}, "lever", {}), entry.get("want"))
    direction = entry.get("direction")
    old, new = _number(before), _number(after)
    if direction not in ("raise", "lower") or old is None or new is None or old == new:
        return None
    return new > old if direction == "raise" else new < old


def primary_indicator(
    changes: Sequence[LeverChange], rules: Rules | None = None
) -> tuple[str, str]:
    """The diff metric a lever flip is judged by, and why: the symptom of the first rule that
    names a changed lever and wants it moved that way (`primary` in diagnosis.yaml)."""
    rules = rules or load_rules()
    table = rules["primary"]
    for change in changes:
        lever = change["lever"]
        for rule in rules["rules"]:
            for entry in rule.get("levers") or []:
                if entry["lever"] != lever:
                    continue
                if _moves_as_wanted(entry, change.get("before"), change.get("after")) is False:
                    continue
                metric = table["symptoms"].get(rule["symptom"])
                if metric:
                    return metric, f"{lever} targets {rule['symptom']} ({rule['title']})"
    return table["default"], "no lever changed that a rule targets" if not changes else (
        f"no rule targets {', '.join(c['lever'] for c in changes)}"
    )


def assess_flip(
    before: Diagnosis,
    after: Diagnosis,
    changes: Sequence[LeverChange],
    rules: Rules | None = None,
) -> list[FlipAssessment]:
    """For each lever change of a diff: the finding of the before side it was meant to fix, and
    whether that rule still holds after (its condition indicators before → after)."""
    rules = rules or load_rules()
    by_id = {r["id"]: r for r in rules["rules"]}
    return [_assess(change, before, after, by_id) for change in changes]


def _assess(
    change: LeverChange, before: Diagnosis, after: Diagnosis, by_id: Mapping[str, Rule]
) -> FlipAssessment:
    lever = change["lever"]
    naming = [f for f in before["findings"] if any(x["lever"] == lever for x in f["levers"])]
    target = next((f for f in naming if any(
        x["lever"] == lever and _moves_as_wanted(x, change.get("before"), change.get("after"))
        is not False for x in f["levers"])), None)  # fmt: skip
    if target is None:
        other = ""
        if naming:
            wanted = next(x for x in naming[0]["levers"] if x["lever"] == lever)
            way = wanted.get("direction") or wanted.get("want")
            other = (f" (its finding {naming[0]['symptom']} ({naming[0]['title']}) wants "
                     f"{lever} {way}: this change goes the other way)")  # fmt: skip
        return FlipAssessment(
            lever=lever,
            before=change.get("before"),
            after=change.get("after"),
            rule=None,
            symptom=None,
            verdict="no diagnosed symptom",
            text=f"{lever}: the before run had no finding this change addresses{other}",
        )
    names = [c["indicator"] for c in by_id[target["rule"]]["when"] if "indicator" in c]
    moved = [MovedIndicator(indicator=n, label=INDICATORS[n].label,
                            before=before["indicators"][n]["value"],
                            after=after["indicators"][n]["value"]) for n in names]  # fmt: skip
    after_rules = {f["rule"] for f in after["findings"]} | {a["rule"] for a in after["already_set"]}
    if target["rule"] in {u["rule"] for u in after["not_judged"]}:
        verdict = "not judged after"
    elif target["rule"] in after_rules:
        verdict = "still present"
    else:
        verdict = "resolved"
    changed = [m for m in moved if m["before"] != m["after"]] or moved
    shifts = ", ".join(f"{m['label']} {show(m['indicator'], m['before'])} → "
                       f"{show(m['indicator'], m['after'])}" for m in changed)  # fmt: skip
    return FlipAssessment(
        lever=lever,
        before=change.get("before"),
        after=change.get("after"),
        rule=target["rule"],
        symptom=target["symptom"],
        indicators=moved,
        verdict=verdict,
        text=f"{lever} was meant to fix {target['symptom']} ({target['title']}): {verdict}; "
        f"{shifts}",
    )
