"""Assemble reports from the store: one run, one run against a base run (`--vs`), or one run
split at its lever flip (`--split-at-flip`). Each opens the store once, read-only, and returns a
`document.Report`, every key of it written once."""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, NotRequired, TypedDict

import duckdb

from servescope.reports import bootstrap, coldstart, replicas, sql
from servescope.reports.charts import charts
from servescope.reports.checklist import checklist
from servescope.reports.diagnosed import Diagnosis
from servescope.reports.diagnosis import assess_flip, diagnose, primary_indicator
from servescope.reports.document import (
    Bootstrap,
    ChecklistItem,
    Compared,
    Decision,
    DiffRow,
    Flip,
    Kind,
    LeverChange,
    Power,
    Primary,
    RepeatState,
    RepeatStates,
    ReplicaChange,
    Report,
    SideReport,
    SpecDecodeDiff,
)
from servescope.reports.document import Design as RepeatsDesign
from servescope.reports.document import Window as WindowDoc
from servescope.reports.indicators import BY_METRIC, Arm
from servescope.reports.judge import judge, power
from servescope.reports.readings import Subject
from servescope.reports.rows import at_level, design, diff_rows, primary_level
from servescope.reports.samples import Slice
from servescope.reports.sequential import Plan
from servescope.reports.sides import (
    flips_in,
    only_numbers,
    report_id,
    side_of,
    side_report,
    sides_of,
    slice_of,
    window_of,
)
from servescope.reports.specdecode import headline_part, spec_diff
from servescope.reports.summary import ReportOptions, recorded_slo, require_run
from servescope.reports.windows import WHOLE, Window
from servescope.reports.wording import (
    describe_change,
    headline,
    lever_changes,
    workload_warnings,
)
from servescope.store import Store
from servescope.store.reads import RunRow


class NoLeverFlip(LookupError):
    """`--split-at-flip` on a run that has no `lever_flips` row."""


class BadComparison(ValueError):
    """Runs that cannot be compared as given (a run named twice), or a `--primary` that names
    no diff metric."""


class NoPreviousRun(LookupError):
    """`--vs previous` on a run that follows no other run of its server."""


PREVIOUS = "previous"
METHOD = (
    "several runs a side: Student's t on the runs' values (logarithms of times and rates), the "
    "runs' request-level bootstrap variance as a floor; one run a side: exact bootstrap "
    "distributions over per-request samples (request noise only). Throughput, goodput and "
    "energy resample windows of the run (1 s, or 1/20 of a shorter run), each request's tokens "
    "counted in the windows they were generated in. The primary row is tested at 5 %, the others "
    "corrected by Holm's procedure (docs/verdicts.md)"
)


def previous_run(con: duckdb.DuckDBPyConnection, run: RunRow) -> str:
    """The run of the same server just before `run`: what `--vs previous` compares with (a
    server session names the one it followed; else the run before it at its target, of its
    collector instance: `sql.PREVIOUS_RUN`)."""
    named = (run["notes"] or {}).get("previous")
    if isinstance(named, str) and named:
        return named
    if run["target"] and run["started_at"]:
        instance = (run["notes"] or {}).get("instance")
        params = {"target": run["target"], "started": run["started_at"], "run_id": run["run_id"],
                  "instance": instance if isinstance(instance, str) else None}  # fmt: skip
        row = con.execute(sql.PREVIOUS_RUN, params).fetchone()
        if row:
            return str(row[0])
    raise NoPreviousRun(
        f"run {run['run_id']!r} follows no other run of its server: give --vs BASE_RUN"
    )


def _with_slo(options: ReportOptions | None, run: RunRow) -> ReportOptions:
    """The SLOs given on the command line, else those the (after) run was benchmarked with."""
    options = options or ReportOptions()
    if options.slo:
        return options
    return replace(options, slo=recorded_slo(run))


def _diagnosis(side: SideReport, slo: dict[str, float] | None) -> Diagnosis:
    """reports/diagnosis.py's findings for one side (it reads the side's numbers and SLOs)."""
    return diagnose(Subject(**side, slo=slo))


def build_summary(
    store: Store, run_id: str, options: ReportOptions | None = None, window: Window = WHOLE
) -> Report:
    """The report of one run (or of a window of it): metadata, overall and per-level numbers,
    server-side deltas, admission evidence, the pass-criteria checklist and charts."""
    with store.read() as con:
        run = require_run(con, run_id)
        part = slice_of(con, run, window)
        options = _with_slo(options, run)
        side = side_of(con, part, options)
        shown = side_report(con, part, run, side, options)
        checks = checklist(con, part, shown["run"], side.summary, options)
        flips = flips_in(con, [run_id], [side])
        drawn = charts([side], flips) if options.charts else {}
    slo = options.slo or None
    return Report(
        report_id=report_id(part),
        kind="run",
        run_id=run_id,
        window=window_of(part),
        levers=shown["levers"],
        run=shown["run"],
        **only_numbers(shown),
        slo=slo,
        checklist=checks,
        flips=flips,
        charts=drawn,
        cold_start=coldstart.rows(shown["run"]["cold_start"]),
        diagnosis=_diagnosis(shown, slo),
    )


@dataclass(frozen=True)
class Comparison:
    """What `--vs` and `--split-at-flip` share: both arms (each a run, or several repeats of one
    configuration), each arm's first run as the report shows it, the diff rows judged as a
    family, the warnings and the charts."""

    arms: tuple[Arm, Arm]
    before: SideReport
    after: SideReport
    changes: list[LeverChange]
    diff: list[DiffRow]
    primary: Primary
    decision: Decision
    repeats: RepeatsDesign
    repeat_states: RepeatStates
    power: Power | None
    cold_start: list[dict[str, Any]]
    replicas_diff: list[ReplicaChange] | None
    spec_decode: SpecDecodeDiff | None
    warnings: list[str]
    flips: list[Flip]
    bootstrap: Bootstrap
    charts: dict[str, str]

    def headline(self, change: str) -> str:
        """The diff's headline, with TPOT and draft acceptance when speculation ran on a side."""
        line = headline(change, self.diff, *self.arms, self.decision)
        shown = list(at_level(self.diff, self.primary["level"]).values())
        spec = headline_part(self.spec_decode, shown)
        return f"{line}; {spec}" if spec else line

    def diagnosis(self, slo: dict[str, float] | None) -> Diagnosis:
        """The after side's diagnosis, the before side's first finding, and whether each lever
        change moved the symptom it was meant to move."""
        before, after = _diagnosis(self.before, slo), _diagnosis(self.after, slo)
        return Diagnosis(
            **after,
            before_first=before["first"],
            flip=assess_flip(before, after, self.changes),
        )


def _compare(
    con: duckdb.DuckDBPyConnection,
    before: list[Slice],
    after: list[Slice],
    runs: tuple[list[RunRow], list[RunRow]],
    changes: list[LeverChange],
    options: ReportOptions,
    stack: ExitStack,
    primary: str | None = None,
) -> Comparison:
    """Both arms compared (the sides' cursors are closed by `stack`); `changes`: the levers
    that differ between them."""
    seed = bootstrap.DEFAULT_SEED if options.seed is None else options.seed
    sides = sides_of(con, [*before, *after], options, stack)
    b_arm = Arm(_arm_name(runs[0]) if len(before) > 1 else before[0].name, sides[: len(before)])
    a_arm = Arm(_arm_name(runs[1]) if len(after) > 1 else after[0].name, sides[len(before) :])
    b_side, a_side = b_arm.repeats[0], a_arm.repeats[0]
    b_shown = side_report(con, before[0], runs[0][0], b_side, options)
    a_shown = side_report(con, after[0], runs[1][0], a_side, options)
    same_run = before[0].run_id == after[0].run_id
    rows, evidence = diff_rows(b_arm, a_arm, seed)
    metric, why = primary_indicator(changes)
    if primary is not None:
        metric, why = primary, "chosen with --primary"
    look = min(len(before), len(after))
    plan = options.plan or _plan_of(runs)
    if options.margin_pct is not None:
        plan = replace(plan, margin_pct=options.margin_pct)
    chosen, decided = judge(rows, evidence, (metric, primary_level(b_arm, a_arm)), why, look,
                            plan, options.stopped)  # fmt: skip
    run_ids = sorted({p.run_id for p in (*before, *after)})
    flips = flips_in(con, run_ids, sides)
    shown = list(at_level(rows, chosen["level"]).values())
    b_run, a_run = b_shown["run"], a_shown["run"]
    return Comparison(
        arms=(b_arm, a_arm),
        before=b_shown,
        after=a_shown,
        changes=changes,
        diff=rows,
        primary=chosen,
        decision=decided,
        repeats=design(b_arm, a_arm),
        repeat_states=_repeat_states(runs),
        power=power(rows, chosen),
        cold_start=[]
        if same_run
        else coldstart.diff_rows(b_run["cold_start"], a_run["cold_start"]),
        replicas_diff=replicas.replicas_diff(b_shown["replicas"], a_shown["replicas"]),
        spec_decode=spec_diff(
            con, (before[0], after[0]), (b_side.summary, a_side.summary), shown, seed
        ),
        warnings=workload_warnings(b_side, a_side, b_run["workload"], a_run["workload"], same_run)
        + _repeat_warnings(runs),
        flips=flips,
        bootstrap=Bootstrap(draws=bootstrap.DRAWS, seed=seed, method=METHOD),
        charts=charts([b_side, a_side], flips) if options.charts else {},
    )


def _plan_of(runs: tuple[list[RunRow], list[RunRow]]) -> Plan:
    """The stopping rule's plan the runs' experiment recorded (`notes.plan`), the default plan
    for runs of none (or of experiments that recorded different ones)."""
    every = [*runs[0], *runs[1]]
    plans = {json.dumps((r["notes"] or {}).get("plan"), sort_keys=True) for r in every}
    found = json.loads(plans.pop()) if len(plans) == 1 else None
    if not isinstance(found, dict):
        return Plan()
    try:
        return Plan(int(found["first"]), int(found["last"]), float(found["margin_pct"]))
    except (KeyError, TypeError, ValueError):
        return Plan()


def _repeat_states(runs: tuple[list[RunRow], list[RunRow]]) -> RepeatStates:
    """How each repeat started (experiments record it in the run's notes), per arm."""

    def state(run: RunRow) -> RepeatState:
        notes = run["notes"] or {}
        return RepeatState(
            run_id=run["run_id"],
            repeat_state=_text(notes.get("repeat_state")),
            repeat_design=_text(notes.get("repeat_design")),
        )

    before, after = runs
    return RepeatStates(before=[state(r) for r in before], after=[state(r) for r in after])


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def _repeat_warnings(runs: tuple[list[RunRow], list[RunRow]]) -> list[str]:
    """Repeats of one arm that did not run one configuration."""
    warnings = []
    for arm, arm_runs in zip(("before", "after"), runs, strict=True):
        first = arm_runs[0]["levers"] or {}
        for run in arm_runs[1:]:
            if changed := lever_changes(first, run["levers"] or {}):
                warnings.append(
                    f"the {arm} repeats differ in levers: {run['run_id']} has "
                    + describe_change(changed, "")
                    + f" against {arm_runs[0]['run_id']}"
                )
    return warnings


def _ids(run_ids: str | Sequence[str]) -> list[str]:
    ids = [run_ids] if isinstance(run_ids, str) else list(run_ids)
    if not ids:
        raise BadComparison("a comparison needs at least one run a side")
    if twice := sorted({r for r in ids if ids.count(r) > 1}):
        raise BadComparison(f"run {twice[0]!r} is named twice: each repeat is a run of its own")
    return ids


def _arm_name(runs: list[RunRow]) -> str:
    """An arm as people say it: the experiment's arm name its runs recorded, else the run."""
    arm = (runs[0]["notes"] or {}).get("arm")
    if isinstance(arm, str) and arm and len(runs) > 1:
        return arm
    return str(runs[0]["run_id"])


def _arm_id(parts: list[Slice]) -> str:
    first = report_id(parts[0])
    return first if len(parts) == 1 else f"{first}-x{len(parts)}"


def _check_primary(primary: str | None) -> None:
    if primary is not None and primary not in BY_METRIC:
        raise BadComparison(f"unknown --primary {primary!r}; choose from {', '.join(BY_METRIC)}")


def build_diff(
    store: Store,
    run_ids: str | Sequence[str],
    base_run_ids: str | Sequence[str],
    options: ReportOptions | None = None,
    window: Window = WHOLE,
    base_window: Window = WHOLE,
    primary: str | None = None,
) -> Report:
    """`run_ids` (after) against `base_run_ids` (before; `previous` = the run its server ran
    before), each a run (whole or a window of it) or several runs of one configuration (its
    repeats, pooled): the first after run's own report keys plus `before`, `after` (each arm's
    first run), `diff`, `primary`, `repeats`, `power`, `headline`, `warnings` and
    `lever_changes`. `primary` names the diff metric the flip is judged by (default: the
    symptom its lever targets, reports/diagnosis.yaml)."""
    after_ids, before_ids = _ids(run_ids), _ids(base_run_ids)
    if (len(after_ids) > 1 or len(before_ids) > 1) and (both := set(after_ids) & set(before_ids)):
        raise BadComparison(
            f"run {sorted(both)[0]!r} is on both sides: an arm's repeats are its own"
        )
    _check_primary(primary)
    with store.read() as con, ExitStack() as stack:
        after_runs = [require_run(con, r) for r in after_ids]
        if before_ids == [PREVIOUS]:
            before_ids = [previous_run(con, after_runs[0])]
        before_runs = [require_run(con, r) for r in before_ids]
        same = before_ids == after_ids and len(after_ids) == 1
        before = [slice_of(con, r, base_window, "before" if same else "") for r in before_runs]
        after = [slice_of(con, r, window, "after" if same else "") for r in after_runs]
        run = after_runs[0]
        options = _with_slo(options, run)
        changes = lever_changes(before_runs[0]["levers"] or {}, run["levers"] or {})
        compared = _compare(
            con, before, after, (before_runs, after_runs), changes, options, stack, primary
        )
        checks = checklist(
            con, after[0], compared.after["run"], compared.arms[1].repeats[0].summary, options
        )
    change = describe_change(changes, f"no lever changed: {_arm_name(after_runs)} vs "
                             f"{_arm_name(before_runs)}")  # fmt: skip
    head = Head(
        report_id=f"{_arm_id(after)}-vs-{_arm_id(before)}",
        kind="diff",
        run_id=after_ids[0],
        base_run_id=before_ids[0],
        window=window_of(after[0]),
        base_window=window_of(before[0]),
    )
    return _comparison_report(head, compared.after, compared, change, checks, options.slo)


class Head(TypedDict):
    """A diff's or a split's report keys of its own: what it is and what it compares."""

    report_id: str
    kind: Kind
    run_id: str
    base_run_id: NotRequired[str]
    window: NotRequired[WindowDoc | None]
    base_window: NotRequired[WindowDoc | None]
    split_at: NotRequired[str]


def _comparison_report(
    head: Head,
    shown: SideReport,
    compared: Comparison,
    change: str,
    checks: list[ChecklistItem],
    slo: dict[str, float] | None,
) -> Report:
    """A diff's or a split's report: its `head`, the numbers of the side it shows at the top
    level, the comparison's keys, the checklist and what the comparison read."""
    slo = slo or None
    return Report(
        **head,
        levers=shown["levers"],
        run=shown["run"],
        **only_numbers(shown),
        **_compared(compared, change),
        slo=slo,
        checklist=checks,
        flips=compared.flips,
        charts=compared.charts,
        cold_start=compared.cold_start,
        diagnosis=compared.diagnosis(slo),
    )


def _compared(compared: Comparison, change: str) -> Compared:
    """The keys a diff and a split add to a report."""
    return Compared(
        headline=compared.headline(change),
        lever_changes=compared.changes,
        warnings=compared.warnings,
        before=compared.before,
        after=compared.after,
        diff=compared.diff,
        primary=compared.primary,
        decision=compared.decision,
        repeats=compared.repeats,
        repeat_states=compared.repeat_states,
        power=compared.power,
        replicas_diff=compared.replicas_diff,
        spec_decode=compared.spec_decode,
        bootstrap=compared.bootstrap,
    )


def _require_flip_inside(run: RunRow, at: datetime) -> None:
    """A server session's flip is its own start (the restart from the session before it): all
    of its requests are after it, so splitting there compares nothing; say which command does."""
    previous = (run["notes"] or {}).get("previous")
    started = run["started_at"]
    if isinstance(previous, str) and previous and isinstance(started, datetime) and at <= started:
        raise NoLeverFlip(
            f"the lever flip of run {run['run_id']!r} is its server's restart from run "
            f"{previous!r}, before all of its requests: compare the two runs with "
            f"servescope report build {run['run_id']} --vs previous"
        )


def build_split(
    store: Store, run_id: str, options: ReportOptions | None = None, primary: str | None = None
) -> Report:
    """One run, before and after its (first) `lever_flips` row; the report's own numbers are
    the whole run's."""
    _check_primary(primary)
    with store.read() as con, ExitStack() as stack:
        run = require_run(con, run_id)
        options = _with_slo(options, run)
        flips = con.execute(sql.RUN_LEVER_FLIPS, {"run_id": run_id}).fetchall()
        if not flips:
            raise NoLeverFlip(f"run {run_id!r} has no lever_flips row to split at")
        at = flips[0][0]
        _require_flip_inside(run, at)
        first = [f for f in flips if f[0] == at]
        changes = [LeverChange(lever=f[1], before=f[2], after=f[3]) for f in first]
        before = Slice(run_id, until=at, label="before flip")
        after = Slice(run_id, since=at, label="after flip")
        whole = Slice(run_id)
        whole_side = side_of(con, whole, options)
        shown = side_report(con, whole, run, whole_side, options)
        compared = _compare(
            con, [before], [after], ([run], [run]), changes, options, stack, primary
        )
        checks = checklist(con, whole, shown["run"], whole_side.summary, options)
    warnings = list(compared.warnings)
    parts = compared.before["overall"]["requests"] + compared.after["overall"]["requests"]
    if (unplaced := shown["overall"]["requests"] - parts) > 0:
        warnings.insert(0, f"{unplaced} events have no timestamp: in neither part")
    if len(flips) > len(first):
        warnings.insert(
            0, f"the run has {len(flips)} lever flips; split at the first ({at.isoformat()}Z)"
        )
    change = describe_change(changes, f"{run_id} at {at.isoformat()}Z")
    head = Head(
        report_id=f"{run_id}-at-flip", kind="split", run_id=run_id, split_at=at.isoformat() + "Z"
    )
    return _comparison_report(
        head, shown, replace(compared, warnings=warnings), change, checks, options.slo
    )
