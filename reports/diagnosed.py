"""report.json's diagnosis as types (reports/diagnosis.py writes it, reports/readings.py
measures its indicators): the workload's shape, the findings with their levers, the levers a
run already holds, the rules not judged, every indicator read, and in a diff what each lever
change did to the symptom it was meant to fix. Part of the published schema through
`document.Report`."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict

# An indicator's value: a number, a text (the most common error class), or null (not measured)
IndicatorValue = float | int | str | None


class WorkloadShape(TypedDict):
    """The workload's shape (chat, batch, rag, agent, mixed or unclassified) and why."""

    shape: str
    why: str
    evidence: list[str]


class OfferedLever(TypedDict):
    """A lever a finding recommends: the value it wants (or the way to move it), the run's."""

    lever: str
    want: Any  # a rule's value for the lever (a flag's value: true, "fp8", 4096…), or null
    direction: str | None  # raise | lower | set | fit | tune, where no value is wanted
    current: Any  # the run's recorded value, vLLM's default where unset, null: not recorded
    note: str | None
    kind: str  # "vLLM flag", or what a lever that is no flag is
    experiment: str | None  # the servescope experiment that tests it


class HeldLever(TypedDict):
    """A lever a rule would recommend that the run already holds."""

    lever: str
    value: Any
    want: Any


class Finding(TypedDict):
    """A rule that holds for the run: its symptom, the evidence with the run's numbers, the
    levers to flip in order, why, and where the rule comes from."""

    rule: str
    symptom: str
    title: str
    evidence: list[str]
    levers: list[OfferedLever]
    why: str
    source: str
    experiment: str | None
    levers_recorded: bool


class AlreadySet(TypedDict):
    rule: str
    symptom: str
    levers: list[HeldLever]


class NotJudged(TypedDict):
    rule: str
    symptom: str | None
    reason: str


class FirstFinding(TypedDict):
    symptom: str
    lever: str
    rule: str


class MeasuredIndicator(TypedDict):
    value: IndicatorValue
    label: str
    source: str


class MovedIndicator(TypedDict):
    """A condition's indicator before and after a lever flip."""

    indicator: str
    label: str
    before: IndicatorValue
    after: IndicatorValue


class FlipAssessment(TypedDict):
    """Whether a lever change of a diff moved the symptom the before side was diagnosed with."""

    lever: str
    before: Any
    after: Any
    rule: str | None
    symptom: str | None
    indicators: NotRequired[list[MovedIndicator]]
    verdict: str  # resolved | still present | not judged after | no diagnosed symptom
    text: str


class Diagnosis(TypedDict):
    """What to flip first (reports/diagnosis.py): a run's, or a diff's after side's with the
    before side's first finding and what each lever change did to it."""

    workload_shape: WorkloadShape
    first: FirstFinding | None
    findings: list[Finding]
    already_set: list[AlreadySet]
    not_judged: list[NotJudged]
    indicators: dict[str, MeasuredIndicator]
    targets: dict[str, float]
    rules_file: str
    before_first: NotRequired[FirstFinding | None]  # a diff's
    flip: NotRequired[list[FlipAssessment]]  # a diff's
