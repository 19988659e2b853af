"""Assemble reports from the store: one run, one run against a base run (`--vs`), or one run
split at its lever flip (`--split-at-flip`). Each opens the store once, read-only."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, closing
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import duckdb

from servescope.reports import bootstrap, coldstart, engines, replicas, sql
from servescope.reports.charts import charts
from servescope.reports.checklist import checklist
from servescope.reports.coldstart import cold_start_of
from servescope.reports.diagnosis import assess_flip, diagnose, primary_indicator
from servescope.reports.diff import (
    BY_METRIC,
    Arm,
    Side,
    at_level,
    attach_gpu,
    describe_change,
    design,
    diff_rows,
    headline,
    judge,
    lever_changes,
    power,
    primary_level,
    workload_warnings,
)
from servescope.reports.samples import Samples, Slice, choose_sources
from servescope.reports.specdecode import headline_part, spec_diff
from servescope.reports.summary import ReportOptions, recorded_slo, require_run, run_meta, summarize
from servescope.reports.windows import WHOLE, Window, resolve
from servescope.reports.windows import label as window_label
from servescope.store import Store, reads


class NoLeverFlip(LookupError):
    """`--split-at-flip` on a run that has no `lever_flips` row."""


class BadComparison(ValueError):
    """Runs that cannot be compared as given (a run named twice), or a `--primary` that names
    no diff metric."""


class NoPreviousRun(LookupError):
    """`--vs previous` on a run that follows no other run of its server."""


PREVIOUS = "previous"


def previous_run(con: duckdb.DuckDBPyConnection, run: dict[str, Any]) -> str:
    """The run of the same server just before `run`: what `--vs previous` compares with (a
    server session names the one it followed)."""
    named = (run.get("notes") or {}).get("previous")
    if isinstance(named, str) and named:
        return named
    if run.get("target") and run.get("started_at"):
        params = {"target": run["target"], "started": run["started_at"], "run_id": run["run_id"]}
        row = con.execute(sql.PREVIOUS_RUN, params).fetchone()
        if row:
            return str(row[0])
    raise NoPreviousRun(
        f"run {run['run_id']!r} follows no other run of its server: give --vs BASE_RUN"
    )


def _slice(
    con: duckdb.DuckDBPyConnection, run: dict[str, Any], window: Window, label: str = ""
) -> Slice:
    """The part of `run` a window selects (the whole run without one)."""
    if not window:
        return Slice(run["run_id"], label=label)
    span = con.execute(sql.RUN_SPAN, {"run_id": run["run_id"]}).fetchone()
    first, last = span if span else (None, None)
    start = run.get("started_at") or first
    end = run.get("ended_at") or last
    since = resolve(window.since, start, end) if window.since else None
    until = resolve(window.until, start, end) if window.until else None
    name = f"{label or run['run_id']} {window_label(since, until)}"
    return Slice(run["run_id"], since=since, until=until, label=name)


def _report_id(part: Slice) -> str:
    if part.since is None and part.until is None:
        return part.run_id
    since = f"{part.since:%Y%m%dT%H%M%SZ}" if part.since else "start"
    until = f"{part.until:%Y%m%dT%H%M%SZ}" if part.until else "end"
    return f"{part.run_id}@{since}-{until}"


def _side(
    con: duckdb.DuckDBPyConnection, part: Slice, options: ReportOptions
) -> tuple[Side, dict[str, Any]]:
    """One side alone (from its own sources); its samples stay readable on `con` (the caller
    keeps it open until the report is built)."""
    samples = Samples(con, part)
    samples.use(choose_sources(samples))
    summary = summarize(con, part, options, samples)
    side = Side(part.name, summary, samples)
    attach_gpu(con, side)
    return side, summary


def _sides(
    con: duckdb.DuckDBPyConnection,
    parts: list[Slice],
    options: ReportOptions,
    stack: ExitStack,
) -> list[Side]:
    """Every run of both arms, each on its own cursor (closed by `stack`), read side by side: a
    quantile's final sort runs on one thread, so sides in parallel use the cores one side alone
    leaves idle. All report TTFT, TPOT and e2e from the same source."""
    cursors = [stack.enter_context(closing(con.cursor())) for _ in parts]
    samples = [Samples(cur, part) for cur, part in zip(cursors, parts, strict=True)]
    sources = choose_sources(*samples)
    for side in samples:
        side.use(sources)
    with ThreadPoolExecutor(max_workers=min(len(parts), 4)) as pool:
        summaries = list(
            pool.map(lambda c, p, s: summarize(c, p, options, s), cursors, parts, samples)
        )
    sides = [
        Side(part.name, summary, side)
        for part, summary, side in zip(parts, summaries, samples, strict=True)
    ]
    for side in sides:
        attach_gpu(con, side)
    return sides


def _span(sides: list[Side]) -> tuple[datetime | None, datetime | None]:
    spans = [span for s in sides if (span := s.samples.span) is not None]
    if not spans:
        return None, None
    lo = min(first for first, _ in spans)
    hi = max(last for _, last in spans)
    return (
        datetime.fromtimestamp(lo, UTC).replace(tzinfo=None),
        datetime.fromtimestamp(hi, UTC).replace(tzinfo=None),
    )


def _flips(con: duckdb.DuckDBPyConnection, run_ids: list[str], sides: list[Side]) -> list[dict]:
    start, end = _span(sides)
    params = {"run_ids": run_ids, "start": start, "end": end}
    flips = reads.rows(con.execute(sql.REPORT_LEVER_FLIPS, params))
    for flip in flips:
        flip["ts"] = flip["ts"].isoformat() + "Z"
    return flips


def _window_of(part: Slice) -> dict[str, str | None] | None:
    if part.since is None and part.until is None:
        return None
    return {
        "since": part.since.isoformat() + "Z" if part.since else None,
        "until": part.until.isoformat() + "Z" if part.until else None,
    }


def _public(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: summary[k] for k in ("overall", "groups", "server", "admission", "gpu")}


def _with_slo(options: ReportOptions | None, run: dict[str, Any]) -> ReportOptions:
    """The SLOs given on the command line, else those the (after) run was benchmarked with."""
    options = options or ReportOptions()
    if options.slo:
        return options
    return replace(options, slo=recorded_slo(run))


def build_summary(
    store: Store, run_id: str, options: ReportOptions | None = None, window: Window = WHOLE
) -> dict[str, Any]:
    """The report of one run (or of a window of it): metadata, overall and per-level numbers,
    server-side deltas, admission evidence, the seeds' checklist and charts."""
    with store.read() as con:
        run = require_run(con, run_id)
        part = _slice(con, run, window)
        options = _with_slo(options, run)
        side, summary = _side(con, part, options)
        meta = run_meta(run, summary["overall"]["models"])
        meta["cold_start"] = cold_start_of(con, run)
        checks = checklist(con, part, meta, summary, options)
        flips = _flips(con, [run_id], [side])
        drawn = charts([side], flips) if options.charts else {}
        by_replica = replicas.fleet(con, part, run, options.prometheus)
        by_engine = engines.of_run(con, part, run)
    report = {
        "report_id": _report_id(part),
        "kind": "run",
        "run_id": run_id,
        "window": _window_of(part),
        "levers": run.get("levers") or {},
        "run": meta,
        **_public(summary),
        **by_replica,
        "engines": by_engine,
        "slo": options.slo or None,
        "checklist": checks,
        "flips": flips,
        "charts": drawn,
        "cold_start": coldstart.rows(meta["cold_start"]),
    }
    report["diagnosis"] = diagnose(report)
    return report


def _compared_diagnosis(
    compared: dict[str, Any], changes: list[dict[str, Any]], slo: dict[str, float] | None
) -> dict[str, Any]:
    """The after side's diagnosis, the before side's first finding, and whether each lever
    change moved the symptom it was meant to move."""
    before = diagnose({**compared["before"], "slo": slo})
    after = diagnose({**compared["after"], "slo": slo})
    return {**after, "before_first": before["first"], "flip": assess_flip(before, after, changes)}


def _compare(
    con: duckdb.DuckDBPyConnection,
    before: list[Slice],
    after: list[Slice],
    runs: tuple[list[dict[str, Any]], list[dict[str, Any]]],
    options: ReportOptions,
    stack: ExitStack,
    primary: str | None = None,
) -> dict[str, Any]:
    """What `--vs` and `--split-at-flip` share: both arms (each a run, or several repeats of one
    configuration), the diff rows judged as a family, the warnings and the charts (the sides'
    cursors are closed by `stack`). `before` and `after` describe each arm's first run."""
    seed = bootstrap.DEFAULT_SEED if options.seed is None else options.seed
    sides = _sides(con, [*before, *after], options, stack)
    b_arm = Arm(before[0].name, sides[: len(before)])
    a_arm = Arm(after[0].name, sides[len(before) :])
    b_side, a_side = b_arm.repeats[0], a_arm.repeats[0]
    b_summary, a_summary = b_side.summary, a_side.summary
    b_meta = run_meta(runs[0][0], b_summary["overall"]["models"])
    a_meta = run_meta(runs[1][0], a_summary["overall"]["models"])
    b_meta["cold_start"] = cold_start_of(con, runs[0][0])
    a_meta["cold_start"] = cold_start_of(con, runs[1][0])
    same_run = before[0].run_id == after[0].run_id
    rows = diff_rows(b_arm, a_arm, seed)
    changes = lever_changes(runs[0][0].get("levers") or {}, runs[1][0].get("levers") or {})
    metric, why = primary_indicator(changes)
    if primary is not None:
        metric, why = primary, "chosen with --primary"
    chosen = judge(rows, (metric, primary_level(b_arm, a_arm)))
    chosen["why"] = why
    if chosen["metric"] != metric:
        chosen["why"] += f"; {metric} is not tested on both sides, so {chosen['metric']} leads"
    run_ids = sorted({p.run_id for p in (*before, *after)})
    flips = _flips(con, run_ids, sides)
    b_fleet = replicas.fleet(con, before[0], runs[0][0], options.prometheus)
    a_fleet = replicas.fleet(con, after[0], runs[1][0], options.prometheus)
    shown = list(at_level(rows, chosen["level"]).values())
    return {
        "sides": (b_arm, a_arm),
        "before": {
            "name": before[0].name,
            "run_id": before[0].run_id,
            "levers": runs[0][0].get("levers") or {},
            "run": b_meta,
            **_public(b_summary),
            **b_fleet,
            "engines": engines.of_run(con, before[0], runs[0][0]),
        },
        "after": {
            "name": after[0].name,
            "run_id": after[0].run_id,
            "levers": runs[1][0].get("levers") or {},
            "run": a_meta,
            **_public(a_summary),
            **a_fleet,
            "engines": engines.of_run(con, after[0], runs[1][0]),
        },
        "diff": rows,
        "primary": chosen,
        "repeats": design(b_arm, a_arm),
        "repeat_states": _repeat_states(runs),
        "power": power(rows, chosen),
        "cold_start": []
        if same_run
        else coldstart.diff_rows(b_meta["cold_start"], a_meta["cold_start"]),
        "replicas_diff": replicas.replicas_diff(b_fleet["replicas"], a_fleet["replicas"]),
        "spec_decode": spec_diff(con, (before[0], after[0]), (b_summary, a_summary), shown, seed),
        "warnings": workload_warnings(
            b_side, a_side, b_meta["workload"], a_meta["workload"], same_run
        )
        + _repeat_warnings(runs),
        "flips": flips,
        "bootstrap": {
            "draws": bootstrap.DRAWS,
            "seed": seed,
            "method": "several runs a side: Student's t on the runs' values (logarithms of "
            "times and rates), the runs' request-level bootstrap variance as a floor; one run a "
            "side: exact bootstrap distributions over per-request samples (request noise only). "
            "Throughput, goodput and energy resample windows of the run (1 s, or 1/20 of a "
            "shorter run), each request's tokens counted in the windows they were generated in. "
            "The primary row is tested at 5 %, the others corrected by Holm's procedure "
            "(docs/verdicts.md)",
        },
        "slo": options.slo or None,
        "charts": charts([b_side, a_side], flips) if options.charts else {},
    }


def _repeat_states(runs: tuple[list[dict[str, Any]], list[dict[str, Any]]]) -> dict[str, Any]:
    """How each repeat started (experiments record it in the run's notes), per arm."""
    keys = ("repeat_state", "repeat_design")
    return {
        arm: [
            {"run_id": r["run_id"], **{k: (r.get("notes") or {}).get(k) for k in keys}}
            for r in arm_runs
        ]
        for arm, arm_runs in zip(("before", "after"), runs, strict=True)
    }


def _repeat_warnings(runs: tuple[list[dict[str, Any]], list[dict[str, Any]]]) -> list[str]:
    """Repeats of one arm that did not run one configuration."""
    warnings = []
    for arm, arm_runs in zip(("before", "after"), runs, strict=True):
        first = arm_runs[0].get("levers") or {}
        for run in arm_runs[1:]:
            if changed := lever_changes(first, run.get("levers") or {}):
                warnings.append(
                    f"the {arm} repeats differ in levers: {run['run_id']} has "
                    + describe_change(changed, "")
                    + f" against {arm_runs[0]['run_id']}"
                )
    return warnings


def _headline(change: str, compared: dict[str, Any], before: Arm, after: Arm) -> str:
    """The diff's headline, with TPOT and draft acceptance when speculation ran on a side."""
    line = headline(change, compared["diff"], before, after, compared["primary"])
    shown = list(at_level(compared["diff"], compared["primary"]["level"]).values())
    spec = headline_part(compared["spec_decode"], shown)
    return f"{line}; {spec}" if spec else line


def _ids(run_ids: str | Sequence[str]) -> list[str]:
    ids = [run_ids] if isinstance(run_ids, str) else list(run_ids)
    if not ids:
        raise BadComparison("a comparison needs at least one run a side")
    if twice := sorted({r for r in ids if ids.count(r) > 1}):
        raise BadComparison(f"run {twice[0]!r} is named twice: each repeat is a run of its own")
    return ids


def _arm_name(runs: list[dict[str, Any]]) -> str:
    """An arm as people say it: the experiment's arm name its runs recorded, else the run."""
    arm = (runs[0].get("notes") or {}).get("arm")
    if isinstance(arm, str) and arm and len(runs) > 1:
        return arm
    return str(runs[0]["run_id"])


def _arm_id(parts: list[Slice]) -> str:
    first = _report_id(parts[0])
    return first if len(parts) == 1 else f"{first}-x{len(parts)}"


def build_diff(
    store: Store,
    run_ids: str | Sequence[str],
    base_run_ids: str | Sequence[str],
    options: ReportOptions | None = None,
    window: Window = WHOLE,
    base_window: Window = WHOLE,
    primary: str | None = None,
) -> dict[str, Any]:
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
    if primary is not None and primary not in BY_METRIC:
        raise BadComparison(f"unknown --primary {primary!r}; choose from {', '.join(BY_METRIC)}")
    with store.read() as con, ExitStack() as stack:
        after_runs = [require_run(con, r) for r in after_ids]
        if before_ids == [PREVIOUS]:
            before_ids = [previous_run(con, after_runs[0])]
        before_runs = [require_run(con, r) for r in before_ids]
        same = before_ids == after_ids and len(after_ids) == 1
        before = [_slice(con, r, base_window, "before" if same else "") for r in before_runs]
        after = [_slice(con, r, window, "after" if same else "") for r in after_runs]
        run = after_runs[0]
        options = _with_slo(options, run)
        compared = _compare(con, before, after, (before_runs, after_runs), options, stack, primary)
        meta = compared["after"]["run"]
        checks = checklist(con, after[0], meta, compared["after"], options)
    b_arm, a_arm = compared.pop("sides")
    drawn = compared.pop("charts")
    changes = lever_changes(before_runs[0].get("levers") or {}, run.get("levers") or {})
    change = describe_change(changes, f"no lever changed: {_arm_name(after_runs)} vs "
                             f"{_arm_name(before_runs)}")  # fmt: skip
    diagnosis = _compared_diagnosis(compared, changes, options.slo or None)
    return {
        "diagnosis": diagnosis,
        "report_id": f"{_arm_id(after)}-vs-{_arm_id(before)}",
        "kind": "diff",
        "run_id": after_ids[0],
        "base_run_id": before_ids[0],
        "window": _window_of(after[0]),
        "base_window": _window_of(before[0]),
        "levers": run.get("levers") or {},
        "run": meta,
        **{
            k: compared["after"][k]
            for k in (
                "overall",
                "groups",
                "server",
                "admission",
                "gpu",
                "replicas",
                "skew",
                "replicas_server",
            )
        },
        "headline": _headline(change, compared, b_arm, a_arm),
        "lever_changes": changes,
        **compared,
        "checklist": checks,
        "charts": drawn,
    }


def _require_flip_inside(run: dict[str, Any], at: datetime) -> None:
    """A server session's flip is its own start (the restart from the session before it): all
    of its requests are after it, so splitting there compares nothing; say which command does."""
    previous = (run.get("notes") or {}).get("previous")
    started = run.get("started_at")
    if isinstance(previous, str) and previous and isinstance(started, datetime) and at <= started:
        raise NoLeverFlip(
            f"the lever flip of run {run['run_id']!r} is its server's restart from run "
            f"{previous!r}, before all of its requests: compare the two runs with "
            f"report build {run['run_id']} --vs previous"
        )


def build_split(
    store: Store, run_id: str, options: ReportOptions | None = None, primary: str | None = None
) -> dict[str, Any]:
    """One run, before and after its (first) `lever_flips` row."""
    if primary is not None and primary not in BY_METRIC:
        raise BadComparison(f"unknown --primary {primary!r}; choose from {', '.join(BY_METRIC)}")
    with store.read() as con, ExitStack() as stack:
        run = require_run(con, run_id)
        options = _with_slo(options, run)
        flips = con.execute(sql.RUN_LEVER_FLIPS, {"run_id": run_id}).fetchall()
        if not flips:
            raise NoLeverFlip(f"run {run_id!r} has no lever_flips row to split at")
        at = flips[0][0]
        _require_flip_inside(run, at)
        first = [f for f in flips if f[0] == at]
        changes = [{"lever": f[1], "before": f[2], "after": f[3]} for f in first]
        before = Slice(run_id, until=at, label="before flip")
        after = Slice(run_id, since=at, label="after flip")
        whole = Slice(run_id)
        _whole_side, summary = _side(con, whole, options)
        by_replica = replicas.fleet(con, whole, run, options.prometheus)
        meta = run_meta(run, summary["overall"]["models"])
        compared = _compare(con, [before], [after], ([run], [run]), options, stack, primary)
        checks = checklist(con, whole, meta, summary, options)
    b_arm, a_arm = compared.pop("sides")
    drawn = compared.pop("charts")
    warnings = compared.pop("warnings")
    parts = compared["before"]["overall"]["requests"] + compared["after"]["overall"]["requests"]
    if (unplaced := summary["overall"]["requests"] - parts) > 0:
        warnings.insert(0, f"{unplaced} events have no timestamp: in neither part")
    if len(flips) > len(first):
        warnings.insert(
            0, f"the run has {len(flips)} lever flips; split at the first ({at.isoformat()}Z)"
        )
    change = describe_change(changes, f"{run_id} at {at.isoformat()}Z")
    diagnosis = _compared_diagnosis(compared, changes, options.slo or None)
    return {
        "diagnosis": diagnosis,
        "report_id": f"{run_id}-at-flip",
        "kind": "split",
        "run_id": run_id,
        "levers": run.get("levers") or {},
        "run": meta,
        **_public(summary),
        **by_replica,
        "split_at": at.isoformat() + "Z",
        "headline": _headline(change, compared, b_arm, a_arm),
        "lever_changes": changes,
        "warnings": warnings,
        **compared,
        "checklist": checks,
        "charts": drawn,
    }
