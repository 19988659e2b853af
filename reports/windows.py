"""Time windows of a run: `--since`/`--until` as a user types them.

A server session can run for weeks, so a report often wants a part of it: "the last 2 hours",
"the first hour after the restart", "the hour before the flip". A time is one of

* an ISO time, `2026-11-24T20:00:00Z` (no zone = UTC);
* a duration ago, `2h`, `30m`, `1d`, `90s`, `1w`;
* a duration from the run's start or end, `start+1h`, `end-30m` (its `runs` row's start and end,
  else its first and last request).

Times in the store are naive UTC; so are the times resolved here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta

from servescope.store.clock import naive_utc, utcnow

_DURATION = re.compile(r"^(?P<n>\d+(?:\.\d+)?)(?P<unit>[smhdw])$")
_ANCHORED = re.compile(r"^(?P<anchor>start|end)(?:(?P<sign>[+-])(?P<duration>.+))?$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


class BadWindow(ValueError):
    """A time that cannot be read; the message says what is accepted."""


@dataclass(frozen=True)
class Window:
    """`--since`/`--until` as typed (None = unbounded)."""

    since: str | None = None
    until: str | None = None

    def __bool__(self) -> bool:
        return self.since is not None or self.until is not None


WHOLE = Window()


def duration(text: str) -> timedelta:
    match = _DURATION.match(text.strip())
    if not match:
        raise BadWindow(f"{text!r} is not a duration (e.g. 90s, 30m, 2h, 1d, 1w)")
    return timedelta(seconds=float(match["n"]) * _UNITS[match["unit"]])


def resolve(
    text: str, start: datetime | None, end: datetime | None, now: datetime | None = None
) -> datetime:
    """The naive UTC time `text` names for a run that spans [start, end]."""
    text = text.strip()
    anchored = _ANCHORED.match(text)
    if anchored:
        base = start if anchored["anchor"] == "start" else end
        if base is None:
            raise BadWindow(f"{text!r}: the run has no {anchored['anchor']} time")
        if anchored["duration"] is None:
            return base
        step = duration(anchored["duration"])
        return base + step if anchored["sign"] == "+" else base - step
    if _DURATION.match(text):
        return (naive_utc(now) if now else utcnow()) - duration(text)
    try:
        ts = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise BadWindow(
            f"{text!r} is not a time: give an ISO time (2026-11-24T20:00:00Z), a duration ago "
            "(2h, 30m, 1d) or one from the run's start or end (start+1h, end-30m)"
        ) from None
    return naive_utc(ts)


def label(since: datetime | None, until: datetime | None) -> str:
    """How a window appears in a report's name: `from … to …` in compact UTC."""
    parts = []
    if since is not None:
        parts.append(f"from {since:%Y%m%dT%H%M%SZ}")
    if until is not None:
        parts.append(f"to {until:%Y%m%dT%H%M%SZ}")
    return " ".join(parts)
