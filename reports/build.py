"""Assemble reports from the store: one run, one run against a base run (`--vs`), or one run
split at its lever flip (`--split-at-flip`). Each opens the store once, read-only."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, closing
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import duckdb

from reports import bootstrap
from reports.charts import charts
from reports.checklist import checklist
from reports.diff import (
    Side,
    describe_change,
    diff_rows,
    headline,
    lever_changes,
    workload_warnings,
)
from reports.samples import Samples, Slice
from reports.summary import ReportOptions, recorded_slo, require_run, run_meta, summarize
from store import Store, queries


class NoLeverFlip(LookupError):
    """`--split-at-flip` on a run that has no `lever_flips` row."""


def _side(
    con: duckdb.DuckDBPyConnection, part: Slice, options: ReportOptions
) -> tuple[Side, dict[str, Any]]:
    """One side's summary; its samples stay readable on `con` (the caller keeps it open until
    the report is built)."""
    samples = Samples(con, part)
    summary = summarize(con, part, options, samples)
    return Side(part.name, summary, samples), summary


def _both_sides(
    con: duckdb.DuckDBPyConnection,
    parts: tuple[Slice, Slice],
    options: ReportOptions,
    stack: ExitStack,
) -> list[tuple[Side, dict[str, Any]]]:
    """Both sides at once, each on its own cursor (closed by `stack`): a quantile's final sort
    runs on one thread, so two sides side by side use the cores one side alone leaves idle."""
    cursors = [stack.enter_context(closing(con.cursor())) for _ in parts]
    with ThreadPoolExecutor(max_workers=len(parts)) as pool:
        futures = [
            pool.submit(_side, cur, part, options) for cur, part in zip(cursors, parts, strict=True)
        ]
        return [f.result() for f in futures]


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
    cursor = con.execute(
        queries.REPORT_LEVER_FLIPS, {"run_ids": run_ids, "start": start, "end": end}
    )
    names = [d[0] for d in cursor.description]
    flips = [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
    for flip in flips:
        flip["ts"] = flip["ts"].isoformat() + "Z"
    return flips


def _public(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: summary[k] for k in ("overall", "groups", "server", "admission")}


def _with_slo(options: ReportOptions | None, run: dict[str, Any]) -> ReportOptions:
    """The SLOs given on the command line, else those the (after) run was benchmarked with."""
    options = options or ReportOptions()
    if options.slo:
        return options
    return replace(options, slo=recorded_slo(run))


def build_summary(
    store: Store, run_id: str, options: ReportOptions | None = None
) -> dict[str, Any]:
    """The report of one run: metadata, overall and per-level numbers, server-side deltas,
    admission evidence, the seeds' checklist and charts."""
    part = Slice(run_id)
    with store.read() as con:
        run = require_run(con, run_id)
        options = _with_slo(options, run)
        side, summary = _side(con, part, options)
        meta = run_meta(run, summary["overall"]["models"])
        checks = checklist(con, part, meta, summary, options)
        flips = _flips(con, [run_id], [side])
        drawn = charts([side], flips) if options.charts else {}
    return {
        "report_id": run_id,
        "kind": "run",
        "run_id": run_id,
        "levers": run.get("levers") or {},
        "run": meta,
        **_public(summary),
        "slo": options.slo or None,
        "checklist": checks,
        "flips": flips,
        "charts": drawn,
    }


def _compare(
    con: duckdb.DuckDBPyConnection,
    before: Slice,
    after: Slice,
    runs: tuple[dict[str, Any], dict[str, Any]],
    options: ReportOptions,
    stack: ExitStack,
) -> dict[str, Any]:
    """What `--vs` and `--split-at-flip` share: both sides, the diff rows, the warnings and the
    charts (the sides' cursors are closed by `stack`)."""
    seed = bootstrap.DEFAULT_SEED if options.seed is None else options.seed
    (b_side, b_summary), (a_side, a_summary) = _both_sides(con, (before, after), options, stack)
    b_meta = run_meta(runs[0], b_summary["overall"]["models"])
    a_meta = run_meta(runs[1], a_summary["overall"]["models"])
    same_run = before.run_id == after.run_id
    rows = diff_rows(b_side, a_side, seed)
    flips = _flips(con, sorted({before.run_id, after.run_id}), [b_side, a_side])
    return {
        "sides": (b_side, a_side),
        "before": {
            "name": before.name,
            "run_id": before.run_id,
            "levers": runs[0].get("levers") or {},
            "run": b_meta,
            **_public(b_summary),
        },
        "after": {
            "name": after.name,
            "run_id": after.run_id,
            "levers": runs[1].get("levers") or {},
            "run": a_meta,
            **_public(a_summary),
        },
        "diff": rows,
        "warnings": workload_warnings(
            b_side, a_side, b_meta["workload"], a_meta["workload"], same_run
        ),
        "flips": flips,
        "bootstrap": {
            "draws": bootstrap.DRAWS,
            "seed": seed,
            "method": "exact bootstrap distributions over per-request samples; throughput and "
            "goodput resample windows of completions (1 s, or 1/20 of a shorter run)",
        },
        "slo": options.slo or None,
        "charts": charts([b_side, a_side], flips) if options.charts else {},
    }


def build_diff(
    store: Store, run_id: str, base_run_id: str, options: ReportOptions | None = None
) -> dict[str, Any]:
    """`run_id` (after) against `base_run_id` (before): `run_id`'s own report keys plus
    `before`, `after`, `diff`, `headline`, `warnings` and `lever_changes`."""
    before, after = Slice(base_run_id), Slice(run_id)
    with store.read() as con, ExitStack() as stack:
        base = require_run(con, base_run_id)
        run = require_run(con, run_id)
        options = _with_slo(options, run)
        compared = _compare(con, before, after, (base, run), options, stack)
        meta = compared["after"]["run"]
        checks = checklist(con, after, meta, compared["after"], options)
    b_side, a_side = compared.pop("sides")
    drawn = compared.pop("charts")
    changes = lever_changes(base.get("levers") or {}, run.get("levers") or {})
    change = describe_change(changes, f"{run_id} vs {base_run_id}")
    return {
        "report_id": f"{run_id}-vs-{base_run_id}",
        "kind": "diff",
        "run_id": run_id,
        "base_run_id": base_run_id,
        "levers": run.get("levers") or {},
        "run": meta,
        **{k: compared["after"][k] for k in ("overall", "groups", "server", "admission")},
        "headline": headline(change, compared["diff"], b_side, a_side),
        "lever_changes": changes,
        **compared,
        "checklist": checks,
        "charts": drawn,
    }


def build_split(store: Store, run_id: str, options: ReportOptions | None = None) -> dict[str, Any]:
    """One run, before and after its (first) `lever_flips` row."""
    with store.read() as con, ExitStack() as stack:
        run = require_run(con, run_id)
        options = _with_slo(options, run)
        flips = con.execute(queries.RUN_LEVER_FLIPS, {"run_id": run_id}).fetchall()
        if not flips:
            raise NoLeverFlip(f"run {run_id!r} has no lever_flips row to split at")
        at = flips[0][0]
        first = [f for f in flips if f[0] == at]
        changes = [{"lever": f[1], "before": f[2], "after": f[3]} for f in first]
        before = Slice(run_id, until=at, label="before flip")
        after = Slice(run_id, since=at, label="after flip")
        whole = Slice(run_id)
        summary = summarize(con, whole, options, Samples(con, whole))
        meta = run_meta(run, summary["overall"]["models"])
        compared = _compare(con, before, after, (run, run), options, stack)
        checks = checklist(con, whole, meta, summary, options)
    b_side, a_side = compared.pop("sides")
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
    return {
        "report_id": f"{run_id}-at-flip",
        "kind": "split",
        "run_id": run_id,
        "levers": run.get("levers") or {},
        "run": meta,
        **_public(summary),
        "split_at": at.isoformat() + "Z",
        "headline": headline(change, compared["diff"], b_side, a_side),
        "lever_changes": changes,
        "warnings": warnings,
        **compared,
        "checklist": checks,
        "charts": drawn,
    }
