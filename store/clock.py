"""Time as servescope stores and writes it: naive UTC `datetime`s in the store's TIMESTAMP
columns, UTC ISO-8601 text with a `Z` in records and reports.

One place for both, in the store's room because every room that stamps or writes a time may
import the store (`wire/` imports nothing of ours: it has no clock of its own). DuckDB's
TIMESTAMP has no zone, so a time is made naive only after it was moved to UTC; a naive time
is taken to be UTC already.
"""

from __future__ import annotations

import functools
import time
from datetime import UTC, datetime


def utcnow() -> datetime:
    """Now in UTC, naive: what the store's TIMESTAMP columns hold."""
    return datetime.now(UTC).replace(tzinfo=None)


def utc_from_epoch(seconds: float) -> datetime:
    """A Unix time (seconds) as a naive UTC `datetime`."""
    return datetime.fromtimestamp(seconds, UTC).replace(tzinfo=None)


def naive_utc(ts: datetime) -> datetime:
    """`ts` in UTC, naive (an aware time converted, a naive one taken as UTC already)."""
    return ts.astimezone(UTC).replace(tzinfo=None) if ts.tzinfo is not None else ts


def iso(ts: datetime) -> str:
    """`ts` as UTC ISO-8601 text with a `Z`, `2026-05-12T09:30:00.123456Z`, as `utc_now_iso`
    writes now (an aware time converted to UTC, a naive one taken as UTC). Always six digits
    of microseconds: texts of one width sort as their times do."""
    return naive_utc(ts).isoformat(timespec="microseconds") + "Z"


def iso_or_none(ts: datetime | None) -> str | None:
    """`iso(ts)`, or None for no time."""
    return iso(ts) if ts is not None else None


def utc_now_iso() -> str:
    """Now as `2026-05-12T09:30:00.123456Z`. Built from `time_ns` with the date and time part
    cached: building a `datetime` and formatting it whole was 4 % of the gateway's CPU per
    request, while that part changes only once a second."""
    seconds, rest = divmod(time.time_ns(), 1_000_000_000)
    return f"{_utc_second(seconds)}.{rest // 1000:06d}Z"


@functools.lru_cache(maxsize=2)
def _utc_second(seconds: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
