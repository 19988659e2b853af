"""Retention of `/metrics` samples: a long-lived collector scrapes every series every few
seconds, forever, so `metric_samples` is what grows without bound.

One rule, used by `servescope collect --retain` (`Retention`, every few minutes) and by
`servescope store prune --before` (`prune`, once):

* samples older than the cutoff (`before`: now minus the retention, or the date given) are
  dropped;
* samples between the cutoff and 24 hours ago (`RECENT`) are downsampled to one a minute per
  series (target, name, labels, run_id): the minute's last sample is kept, with its own
  timestamp and value, and the others of that minute are deleted. For a counter (cumulative)
  the last value is exactly what `rate()` and a run's counter growth need (the growth between
  two kept samples is the sum of the steps dropped between them); for a gauge it is the
  minute's closing value, so a peak inside a minute older than a day is lost;
* samples of the last 24 hours are untouched, as is every other table: requests (`events`),
  `runs`, `lever_flips`, `runtime_events`, `ingest_errors`, `checkpoints`.

Every change is a DELETE in the store's write transaction (`Store.write`), one transaction per
slice of time holding about `SLICE_ROWS` samples, so a writer in another process (a collector, a
`bench run`) waits at most one slice. DuckDB reuses the space deleted rows leave; the file does
not shrink.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta

import duckdb

from servescope.store import queries
from servescope.store.clock import iso, iso_or_none, naive_utc, utcnow
from servescope.store.db import Store

RECENT = timedelta(hours=24)  # kept at full resolution
SLICE_ROWS = 500_000  # samples looked at per transaction, about
INTERVAL_S = 300.0  # how often a collector applies its retention
MINUTE = timedelta(minutes=1)
EPOCH = datetime(1, 1, 1)  # before any sample
LONGEST = timedelta(days=365_000)  # far enough; `now - keep` stays a date

_DURATION = re.compile(r"(?P<n>[1-9][0-9]*)(?P<unit>[mhdw])")
_UNITS = {"m": timedelta(minutes=1), "h": timedelta(hours=1), "d": timedelta(days=1),
          "w": timedelta(weeks=1)}  # fmt: skip


class BadRetention(ValueError):
    """A retention or a date that cannot be read; the message says what is accepted."""


def parse_duration(text: str) -> timedelta:
    """A retention as typed: a whole number and a unit, `90m`, `36h`, `14d`, `2w`."""
    match = _DURATION.fullmatch(text)
    if not match:
        raise BadRetention(
            f"{text!r} is not a duration: give a whole number and a unit, m (minutes), h "
            "(hours), d (days) or w (weeks), e.g. 36h, 14d, 2w"
        )
    try:
        keep = int(match["n"]) * _UNITS[match["unit"]]
    except (OverflowError, ValueError):  # past timedelta's range, or int()'s digits
        keep = LONGEST + MINUTE
    if keep > LONGEST:
        raise BadRetention(f"{text!r} is longer than the longest retention, 1000 years")
    return keep


def parse_before(text: str) -> datetime:
    """`--before` as typed: an ISO date (`2026-11-13`, midnight) or date and time
    (`2026-11-13T06:00:00Z`); no zone = UTC. Returned as the store keeps times: naive UTC."""
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise BadRetention(
            f"{text!r} is not a date: give an ISO date or date and time in UTC, e.g. "
            "2026-11-13 or 2026-11-13T06:00:00Z"
        ) from None
    return naive_utc(when)


def _floor_minute(when: datetime) -> datetime:
    return when.replace(second=0, microsecond=0)


@dataclass
class Pruned:
    """What one application of the rule did (or, dry, would do)."""

    before: datetime  # samples older than this are dropped
    downsample_from: datetime | None  # downsampled window, [from, until): None when empty
    downsample_until: datetime | None
    dropped: int = 0  # samples older than `before` deleted
    downsampled: int = 0  # samples deleted by downsampling (the minute's last one stays)
    done: bool = True  # False: stopped at its time budget, the rest is for the next pass
    dry_run: bool = False

    def as_json(self) -> dict[str, str | int | bool | None]:
        """The result as `store prune --json` prints it: times as UTC ISO text."""
        times = {"before": iso(self.before), "downsample_from": iso_or_none(self.downsample_from),
                 "downsample_until": iso_or_none(self.downsample_until)}  # fmt: skip
        return {**asdict(self), **times}


def prune(
    store: Store,
    before: datetime,
    *,
    now: datetime | None = None,
    since: datetime | None = None,
    dry_run: bool = False,
    budget_s: float | None = None,
) -> Pruned:
    """Drop the samples older than `before`; downsample those from `before` (or `since`, where
    an earlier pass stopped, if later) to the minute 24 hours before `now` to one a minute per
    series. `budget_s` bounds the time spent downsampling (at least one slice is done): the
    result's `downsample_until` says how far it got. `dry_run` counts and changes nothing."""
    now = now or utcnow()
    until = _floor_minute(now - RECENT)
    start = max(before, since) if since is not None else before
    result = Pruned(before, None, None, dry_run=dry_run)
    if start < until:
        result.downsample_from = result.downsample_until = start
    if dry_run:
        with store.read() as con:
            result.dropped = _count(con, queries.SAMPLES_IN_WINDOW, _window(EPOCH, before), 1)
            if start < until:
                window = _window(start, until)
                result.downsampled = _count(con, queries.COUNT_SUPERSEDED_SAMPLES, window)
                result.downsample_until = until
        return result
    for edge, end in _slices(store, EPOCH, before):
        with store.write() as con:
            result.dropped += _count(con, queries.DROP_SAMPLES, _window(edge, end))
    if start >= until:
        return result
    deadline = None if budget_s is None else time.monotonic() + budget_s
    for edge, end in _slices(store, start, until):
        with store.write() as con:
            result.downsampled += _count(con, queries.DOWNSAMPLE_SAMPLES, _window(edge, end))
        result.downsample_until = end
        if deadline is not None and time.monotonic() >= deadline and end < until:
            result.done = False
            break
    else:
        result.downsample_until = until
    return result


def _window(start: datetime, end: datetime) -> dict[str, datetime]:
    return {"start": start, "end": end}


def _slices(store: Store, start: datetime, end: datetime) -> list[tuple[datetime, datetime]]:
    """[start, end) cut at whole minutes into slices of about `SLICE_ROWS` samples each (as
    if spread evenly from the oldest sample on); none when it holds no sample."""
    with store.read() as con:
        row = con.execute(queries.SAMPLES_IN_WINDOW, _window(start, end)).fetchone()
    oldest, rows = (row[0], int(row[1])) if row else (None, 0)
    if oldest is None or not rows:
        return []
    edge = max(start, _floor_minute(oldest))
    parts = -(-rows // SLICE_ROWS)
    span = max(MINUTE, _floor_minute(datetime.min + (end - edge) / parts + MINUTE) - datetime.min)
    slices = []
    while edge < end:
        cut = min(end, _floor_minute(edge) + span)
        slices.append((edge, cut))
        edge = cut
    return slices


def sample_count(store: Store) -> int:
    """How many samples `metric_samples` holds."""
    with store.read() as con:
        return _count(con, queries.COUNT_SAMPLES, {})


def _count(
    con: duckdb.DuckDBPyConnection, sql: str, params: dict[str, datetime], column: int = 0
) -> int:
    row = con.execute(sql, params).fetchone()
    return int(row[column]) if row and row[column] is not None else 0


class Retention:
    """A collector's retention (`servescope collect --retain`): each `apply` drops what is
    older than `keep` and downsamples what crossed the 24-hour line since the last pass. The
    first pass (at start) covers the whole store; later ones only the minutes that aged since,
    so a pass with nothing to do is two range scans on the samples' time zone maps."""

    def __init__(self, store: Store, keep: timedelta, *, budget_s: float = 2.0) -> None:
        self.store = store
        self.keep = keep
        self.budget_s = budget_s
        self.done_until: datetime | None = None  # downsampled up to here by this process

    def apply(self, now: datetime | None = None) -> Pruned:
        now = now or utcnow()
        result = prune(
            self.store, now - self.keep, now=now, since=self.done_until, budget_s=self.budget_s
        )
        if result.downsample_until is not None:
            self.done_until = result.downsample_until
        return result
