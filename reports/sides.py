"""The sides of a report: the part of a run each covers (a window, or before/after a flip),
read from the store into its summary, samples and GPU figures, several side by side on their
own cursors, and shown as a report shows a side: its numbers, its fleet's replicas, its
engines and what its `runs` row says; the lever flips inside their span."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, closing
from datetime import datetime

import duckdb

from servescope.reports import engines, replicas, sql
from servescope.reports.coldstart import cold_start_of
from servescope.reports.document import Flip, Numbers, SideReport
from servescope.reports.document import Window as WindowDoc
from servescope.reports.indicators import Side, attach_gpu
from servescope.reports.samples import Samples, Slice, choose_sources
from servescope.reports.summary import ReportOptions, run_meta, summarize
from servescope.reports.windows import Window, resolve
from servescope.reports.windows import label as window_label
from servescope.store.clock import utc_from_epoch
from servescope.store.reads import RunRow, picked, rows


def slice_of(con: duckdb.DuckDBPyConnection, run: RunRow, window: Window, label: str = "") -> Slice:
    """The part of `run` a window selects (the whole run without one)."""
    if not window:
        return Slice(run["run_id"], label=label)
    span = con.execute(sql.RUN_SPAN, {"run_id": run["run_id"]}).fetchone()
    first, last = span if span else (None, None)
    start = run["started_at"] or first
    end = run["ended_at"] or last
    since = resolve(window.since, start, end) if window.since else None
    until = resolve(window.until, start, end) if window.until else None
    name = f"{label or run['run_id']} {window_label(since, until)}"
    return Slice(run["run_id"], since=since, until=until, label=name)


def report_id(part: Slice) -> str:
    if part.since is None and part.until is None:
        return part.run_id
    since = f"{part.since:%Y%m%dT%H%M%SZ}" if part.since else "start"
    until = f"{part.until:%Y%m%dT%H%M%SZ}" if part.until else "end"
    return f"{part.run_id}@{since}-{until}"


def side_of(con: duckdb.DuckDBPyConnection, part: Slice, options: ReportOptions) -> Side:
    """One side alone (from its own sources); its samples stay readable on `con` (the caller
    keeps it open until the report is built)."""
    samples = Samples(con, part)
    samples.use(choose_sources(samples))
    side = Side(part.name, summarize(con, part, options, samples), samples)
    attach_gpu(con, side)
    return side


def sides_of(
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
    for each in samples:
        each.use(sources)
    with ThreadPoolExecutor(max_workers=min(len(parts), 4)) as pool:
        summaries = list(
            pool.map(lambda c, p, s: summarize(c, p, options, s), cursors, parts, samples)
        )
    sides = [
        Side(part.name, summary, each)
        for part, summary, each in zip(parts, summaries, samples, strict=True)
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
        utc_from_epoch(lo),
        utc_from_epoch(hi),
    )


def flips_in(con: duckdb.DuckDBPyConnection, run_ids: list[str], sides: list[Side]) -> list[Flip]:
    start, end = _span(sides)
    params = {"run_ids": run_ids, "start": start, "end": end}
    return [
        picked(Flip, {**flip, "ts": flip["ts"].isoformat() + "Z"})
        for flip in rows(con.execute(sql.REPORT_LEVER_FLIPS, params))
    ]


def window_of(part: Slice) -> WindowDoc | None:
    if part.since is None and part.until is None:
        return None
    return WindowDoc(
        since=part.since.isoformat() + "Z" if part.since else None,
        until=part.until.isoformat() + "Z" if part.until else None,
    )


def _numbers(
    con: duckdb.DuckDBPyConnection, part: Slice, run: RunRow, side: Side, options: ReportOptions
) -> Numbers:
    """A slice's numbers as a report shows them: its summary, a fleet's replicas and a
    data-parallel server's engines."""
    return Numbers(
        **side.summary,
        **replicas.fleet(con, part, run, options.prometheus),
        engines=engines.of_run(con, part, run),
    )


def side_report(
    con: duckdb.DuckDBPyConnection, part: Slice, run: RunRow, side: Side, options: ReportOptions
) -> SideReport:
    """One run (or window) of a report, with what its `runs` row says."""
    meta = run_meta(run, side.summary["overall"]["models"], cold_start_of(con, run))
    return SideReport(
        name=part.name,
        run_id=part.run_id,
        levers=run["levers"] or {},
        run=meta,
        **_numbers(con, part, run, side, options),
    )


def only_numbers(side: SideReport) -> Numbers:
    """A side's numbers without its name, run id, levers and run (what a report's top level
    repeats of its after side)."""
    return picked(Numbers, side)
