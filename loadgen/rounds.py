"""How many repeats an experiment runs: a fixed count, or rounds until the evidence decides.

A round runs every arm once, interleaved (A B, then B A, …) so that a drift of the machine
lands on every arm alike. A fixed design (`--repeats N`) runs N rounds. A sequential one (the
default) looks at the evidence after every round from the plan's first: `decide` (the
command's: it builds the pooled comparisons from the store and reads the stopping rule of
reports/sequential.py, which stays valid however many looks are taken) says whether every
comparison is decided, and the rounds stop then, at the plan's last round, or when the time
budget would not fit another round.

At the first look the runs may grow. A run's value (TTFT p50 of its requests) varies from run
to run for two reasons: its requests are a sample, and the run as a whole drifts (a restart, a
warmer cache). When the requests' noise makes most of that variance, more requests a run buy
more evidence than more runs do, so the later runs send more of them: as many as bring the
request noise down to the drift, at most MAX_GROWTH times as many, and no more than lets two
more rounds fit the budget.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from servescope.store.notes import PlanNotes

MAX_GROWTH = 4.0  # later runs send at most this many times the requests of the first ones
MIN_GROWTH = 1.5  # below this, growing the runs is not worth changing them
# why the rounds stopped (ExperimentResult.stopped)
DECIDED, BUDGET, MAX_REPEATS, FIXED = "decided", "budget", "max repeats", "fixed"


def round_arms(arms: list[str], repeat: int) -> list[str]:
    """The arms of round `repeat` (1-based): the spec's order, reversed every other round, so
    that a linear drift, which A B A B would hand to B every time, falls on every arm alike."""
    return list(arms) if repeat % 2 else list(reversed(arms))


@dataclass(frozen=True)
class Look:
    """What the evidence said after a round: whether every comparison is decided, each one's
    decision in words, and the largest share of one run's variance its requests' noise makes
    (None: unknown)."""

    decided: bool
    words: list[str]
    request_share: float | None = None


@dataclass(frozen=True)
class Stopping:
    """The sequential plan: looks after `first` … `last` rounds, a time budget for the whole
    experiment (servers' start included), the margin within which a change counts as none."""

    first: int
    last: int
    budget_s: float | None
    margin_pct: float

    def notes(self) -> PlanNotes:
        """What every run records (`notes.plan`): a report of the stored runs reads them with
        the same rule."""
        return {"first": self.first, "last": self.last, "margin_pct": self.margin_pct,
                "budget_s": self.budget_s}  # fmt: skip


Decide = Callable[[int], Look]  # rounds run so far → what the evidence says


@dataclass
class Rounds:
    """The rounds of one experiment: which arms run in which order, and when to stop."""

    arms: list[str]
    fixed: int | None = None  # a fixed design's rounds; None: sequential
    stopping: Stopping | None = None
    decide: Decide | None = None
    started: float = field(default_factory=time.monotonic)
    stopped: str = ""
    looks: list[Look] = field(default_factory=list)
    growth: float | None = None  # the factor the runs grew by at the first look
    sizing: str | None = None  # why, in words
    seconds: list[float] = field(default_factory=list)  # each round's

    @property
    def planned(self) -> int:
        """At most this many rounds."""
        if self.fixed is not None:
            return self.fixed
        return self.stopping.last if self.stopping is not None else 1

    def order(self, repeat: int) -> list[str]:
        return round_arms(self.arms, repeat)

    def another(self, done: int) -> bool:
        """Whether to run round `done + 1`; when not, `stopped` says why."""
        if self.fixed is not None or self.stopping is None:
            if done >= self.planned:
                self.stopped = FIXED
                return False
            return True
        if self.looks and self.looks[-1].decided:
            self.stopped = DECIDED
            return False
        if done >= self.stopping.last:
            self.stopped = MAX_REPEATS
            return False
        budget = self.stopping.budget_s
        if budget is not None and self.seconds and self.elapsed() + self.seconds[-1] > budget:
            self.stopped = BUDGET
            return False
        return True

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def finished(self, done: int, seconds: float) -> Look | None:
        """Round `done` took `seconds`: look at the evidence when the plan says so."""
        self.seconds.append(seconds)
        if self.stopping is None or self.decide is None or done < self.stopping.first:
            return None
        look = self.decide(done)
        self.looks.append(look)
        if done == self.stopping.first and not look.decided:
            self.growth = self._growth(look, seconds)
        return look

    def _growth(self, look: Look, seconds: float) -> float | None:
        """How much longer the runs after the first look should be (None: as they are)."""
        share = look.request_share
        if share is None or share <= 0.5:
            return None
        factor = MAX_GROWTH if share >= 1.0 else min(MAX_GROWTH, share / (1.0 - share))
        budget = self.stopping.budget_s if self.stopping is not None else None
        if budget is not None and seconds > 0:
            left = budget - self.elapsed()
            factor = min(factor, left / (2 * seconds))  # two more rounds must still fit
        if factor < MIN_GROWTH:
            return None
        factor = math.floor(factor * 10) / 10
        later = self.stopping.first + 1 if self.stopping else 0
        self.sizing = (
            f"requests made {share * 100:.0f} % of one run's variance of the primary indicator "
            f"at the first look, so the runs from repeat {later} send ×{factor:g} the requests"
        )
        return factor

    def words(self) -> str:
        """Why the experiment stopped, in words."""
        done = len(self.seconds)
        if self.stopped == DECIDED:
            return f"decided after {done} repeats a side"
        if self.stopped == BUDGET and self.stopping is not None:
            return (
                f"the time budget ({self.stopping.budget_s:.0f} s) would not fit another round "
                f"after {done} repeats a side"
            )
        if self.stopped == MAX_REPEATS:
            return f"the plan's {done} repeats a side were run (--max-repeats)"
        if self.stopped == FIXED:
            return f"the design's {done} repeats a side were run (--repeats)"
        return f"interrupted after {done} repeats a side"
