"""From a run's indicators to the lever to flip first: vLLM's tuning tables as data.

The rules are rows of `diagnosis.yaml` (the vLLM tuning matrix, the tuning decision tree, the
workload table, split by symptom as the Serving Incident Flow does), each with its thresholds
and its source; this engine only checks conditions on the indicators reports/readings.py
measures, so a rule is audited and changed in the YAML without reading code. `diagnose(report)`
reads one report side (`build_summary`'s, or one side of a diff) and returns the workload's
shape, findings in the rules' order (symptom, evidence with the run's numbers, levers in order,
why, the experiment that tests the first lever), recommendations withheld because the run's
levers already hold them, and what could not be judged. `assess_flip` says whether a diff's
lever change moved the symptom it was meant to move.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, NotRequired, Required, TypedDict

import yaml

from servescope.reports.diagnosed import (
    AlreadySet,
    Diagnosis,
    Finding,
    FirstFinding,
    FlipAssessment,
    HeldLever,
    MeasuredIndicator,
    MovedIndicator,
    NotJudged,
    OfferedLever,
    WorkloadShape,
)
from servescope.reports.document import LeverChange
from servescope.reports.readings import INDICATORS, Subject, Values, indicators, show

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


Levers = Mapping[str, object]  # a run's levers as recorded (free-form: the server's flags)


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


# -- conditions ----------------------------------------------------------------------------------


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
