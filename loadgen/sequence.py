"""An experiment's runs in rounds: the run order (A B, B A, …), what each run records (its notes,
the lever flips from the run before it), the results kept in run order and paired into the
comparisons reports make, and `run_rounds`, which makes the rounds until the design stops them
(loadgen/rounds.py) — for `Experiment` and loadgen/fleet.py's `FleetExperiment` alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol, Required, TypedDict

from servescope.loadgen.launcher import Levers, Profile, VllmServer
from servescope.loadgen.rounds import Look, Rounds, Stopping, round_arms
from servescope.loadgen.runner import RunOptions, RunResult
from servescope.loadgen.spec import ExperimentError, ExperimentSpec
from servescope.loadgen.workload import BenchConfig
from servescope.store import Store
from servescope.store.notes import RunNotes

DEFAULT_LEVER = "default"  # a lever a profile leaves to vLLM's own default
DEFAULT_REPEATS = 3  # rounds of a fixed design when no stopping plan is given


def interleaved(arms: list[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, arm) in run order: A B, B A, A B, … (three arms: A B C, C B A, …)."""
    return [(r, arm) for r in range(1, repeats + 1) for arm in round_arms(arms, r)]


def order_letters(arms: list[str], repeats: int) -> str:
    """The run order as letters, e.g. "A B B A A B" (A = the first arm of the spec)."""
    letter = {arm: chr(ord("A") + i) for i, arm in enumerate(arms)}
    return " ".join(letter[arm] for _repeat, arm in interleaved(arms, repeats))


def lever_flips(before: Levers, after: Levers) -> list[tuple[str, str, str]]:
    """(lever, before, after) for every lever whose value differs; a lever one side leaves
    unset is `default` (vLLM's own default) on that side."""
    flips = []
    for lever in sorted(set(before) | set(after)):
        old, new = before.get(lever, DEFAULT_LEVER), after.get(lever, DEFAULT_LEVER)
        if old != new:
            flips.append((lever, str(old), str(new)))
    return flips


@dataclass
class ExperimentRun:
    profile: str
    repeat: int
    run_id: str
    levers: Levers
    target: str
    result: RunResult | None = None
    server_ready_s: float | None = None
    arm: str = ""  # the arm's name: the profile's, or `<profile>-a` in an A/A experiment
    notes: RunNotes = field(default_factory=lambda: RunNotes())

    def __post_init__(self) -> None:
        self.arm = self.arm or self.profile


def record_flips(
    store: Store, experiment: str, run: ExperimentRun, previous: ExperimentRun | None
) -> None:
    """A `lever_flips` row for each lever the run changes from the run before it (none for
    an experiment's first run): what reports split on and dashboards annotate."""
    if previous is None:
        return
    for lever, before, after in lever_flips(previous.levers, run.levers):
        store.add_lever_flip(
            lever,
            before,
            after,
            run_id=run.run_id,
            before_run_id=previous.run_id,
            note=f"experiment {experiment}: {previous.arm} -> {run.arm}",
        )


class Sidecar(Protocol):
    """Something that watches the experiment's servers from outside: the vLLM flags and
    environment it needs, told when a run's requests are all answered, closed at the end."""

    flags: list[str]
    env: dict[str, str]

    def settle(self, run_id: str) -> None:
        """Return once what the servers said about the run's requests is stored."""

    def close(self) -> None: ...


# (the log a server appends to, the URL it listens on) -> a sidecar
SidecarFactory = Callable[[Path, str], Sidecar]


def _unseen_server(_arm: str, _server: VllmServer) -> None:
    """No display: a server starts or gets ready unseen."""


def _unseen_switch(_arm: str, _seconds: float) -> None:
    """No display: a server sleeps or wakes unseen."""


def _unseen_look(_done: int, _look: Look) -> None:
    """No display: a look at the evidence goes unseen."""


@dataclass
class ExperimentHooks:
    """What a display needs: called before a server starts, when it is ready, when one is put to
    sleep or woken (its arm, the seconds it took), and at each look at the evidence; the sidecar
    to start next to the servers, if any; and `judge`, which reads the evidence of the runs so
    far (the pooled comparisons, by the stopping rule) for a sequential design."""

    starting: Callable[[str, VllmServer], None] = _unseen_server
    ready: Callable[[str, VllmServer], None] = _unseen_server
    slept: Callable[[str, float], None] = _unseen_switch
    woke: Callable[[str, float], None] = _unseen_switch
    looked: Callable[[int, Look], None] = _unseen_look
    sidecar: SidecarFactory | None = None
    judge: Callable[[ExperimentResult], Look] | None = None


# (config, target, store, run options) -> the run's result
Executor = Callable[[BenchConfig, str, Store, RunOptions], RunResult]


@dataclass
class Comparison:
    """Two consecutive arms of the spec (before, after) and the runs of each, in run order."""

    before: str
    after: str
    before_runs: list[ExperimentRun]
    after_runs: list[ExperimentRun]


class Described(Protocol):
    """What `run_notes` reads of an experiment (Experiment and loadgen/fleet.py's)."""

    spec: ExperimentSpec
    experiment_id: str
    repeats: int
    design: str
    stopping: Stopping | None


def run_notes(
    experiment: Described, run: ExperimentRun, position: int, order: str, design: str | None = None
) -> RunNotes:
    """What every experiment run records in its notes: which experiment, arm and repeat, where
    it fell in the order, and how its servers were sequenced (`repeat_design`)."""
    notes: RunNotes = {
        "experiment": experiment.spec.name,
        "experiment_id": experiment.experiment_id,
        "profile": run.profile,
        "arm": run.arm,
        "repeat": run.repeat,
        "repeats": experiment.repeats,
        "position": position,
        "order": order,
        "repeat_design": design or experiment.design,
    }
    if experiment.stopping:
        notes["plan"] = experiment.stopping.notes()
    return notes


@dataclass
class ExperimentResult:
    name: str
    experiment_id: str
    runs: list[ExperimentRun] = field(default_factory=list)
    status: str = "complete"  # complete | partial (Ctrl-C) | failed (a run failed or a server)
    failure: str | None = None
    arms: list[str] = field(default_factory=list)  # in the spec's order (the first: before)
    design: str = ""  # how servers and rounds were sequenced (KEPT_UP, SLEEP, FRESH, …)
    order: str = ""  # the run order, e.g. "A B B A A B"
    stopped: str = ""  # why the rounds stopped (loadgen/rounds.py: decided, budget, …)
    stop_words: str = ""  # … in words
    sizing: str | None = None  # how the runs grew at the first look, and why
    looks: list[Look] = field(default_factory=list)

    def record(self, run: ExperimentRun) -> bool:
        """Keep a measured run; False (the experiment stops) when it did not complete."""
        self.runs.append(run)
        assert run.result is not None
        if run.result.status != "complete":
            self.status = "partial" if run.result.status == "partial" else "failed"
            self.failure = run.result.failure
            return False
        return True

    def _arms(self) -> list[str]:
        return self.arms or list(dict.fromkeys(run.arm for run in self.runs))

    def measured(self, arm: str) -> list[ExperimentRun]:
        return [r for r in self.runs if r.arm == arm and r.result is not None]

    def comparisons(self) -> list[Comparison]:
        """One per pair of consecutive arms of the spec (max-num-seqs' three profiles: two),
        with every measured run of each: what a pooled before/after report compares."""
        arms = self._arms()
        out = []
        for before, after in zip(arms, arms[1:], strict=False):
            b, a = self.measured(before), self.measured(after)
            if b and a:
                out.append(Comparison(before, after, b, a))
        return out

    def pairs(self) -> list[tuple[ExperimentRun, ExperimentRun]]:
        """(before, after) of every comparison within each repeat both arms ran in: the
        per-repeat reports kept beside the pooled one."""
        out = []
        for comparison in self.comparisons():
            after = {run.repeat: run for run in comparison.after_runs}
            for run in comparison.before_runs:
                if run.repeat in after:
                    out.append((run, after[run.repeat]))
        return out


class RunFailed(RuntimeError):
    """A run that could not be made (its server, its target, its gateway): the experiment
    stops, failed, with this message."""


def fixed_or_sequential(
    spec: ExperimentSpec, repeats: int | None, stopping: Stopping | None
) -> tuple[int | None, Stopping | None]:
    """(fixed rounds, None) for a fixed design (`--repeats`, or the spec's `repeats`), else
    (None, the stopping plan); a fixed design of DEFAULT_REPEATS when neither is given."""
    fixed = repeats if repeats is not None else spec.repeats
    if fixed is not None and fixed < 1:
        raise ExperimentError(f"--repeats must be positive, got {fixed}")
    if fixed is None and stopping is None:
        fixed = DEFAULT_REPEATS
    return fixed, None if fixed is not None else stopping


class ExperimentOptions(TypedDict, total=False):
    """The options both kinds of experiment take (`Experiment`, loadgen/fleet.py's
    `FleetExperiment`): where runs are stored and what makes one, the model, how many rounds
    (`repeats`, or a `stopping` plan), their size (`scale`, `requests`), the SLOs, the display's
    hooks, the lever profiles (default: profiles.yaml)."""

    store: Required[Store]
    execute: Required[Executor]
    model: Required[Path]
    repeats: int | None
    scale: float | None
    requests: int | None
    slo: dict[str, float] | None
    hooks: ExperimentHooks | None
    profiles: dict[str, Profile] | None
    stopping: Stopping | None


class ExperimentBase:
    """What both kinds of experiment hold of their spec and options: the store, the executor,
    the model, the rounds' design (fixed or sequential), the bench config, the SLOs, the hooks
    and the experiment's id."""

    def __init__(self, spec: ExperimentSpec, options: ExperimentOptions) -> None:
        self.spec = spec
        self.store = options["store"]
        self.execute = options["execute"]
        self.model = options["model"]
        self.fixed, self.stopping = fixed_or_sequential(
            spec, options.get("repeats"), options.get("stopping")
        )
        self.repeats = self.fixed or (self.stopping.last if self.stopping else DEFAULT_REPEATS)
        self.slo = options.get("slo") or {}
        self.hooks = options.get("hooks") or ExperimentHooks()
        self.config = spec.bench_config(options.get("scale"), options.get("requests"))
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        self.experiment_id = f"exp-{stamp}-{spec.name}"
        self._stamp = stamp


class Sequenced(Protocol):
    """What `run_rounds` needs of an experiment (Experiment and loadgen/fleet.py's)."""

    fixed: int | None
    stopping: Stopping | None
    hooks: ExperimentHooks
    config: BenchConfig

    def run_for(self, repeat: int, arm: str) -> ExperimentRun: ...


def run_rounds(
    experiment: Sequenced,
    result: ExperimentResult,
    one: Callable[[ExperimentRun, ExperimentRun | None, int], None],
) -> None:
    """Rounds of every arm (A B, B A, …) until the design stops them, each run made by `one`
    (run, the run before it, its position) and recorded in `result`; a run that did not
    complete, a failure (RunFailed) or Ctrl-C stops the experiment there. After each round
    from the plan's first, the hooks' `judge` reads the evidence; at the first look the runs
    may grow (loadgen/rounds.py). `result` says why the rounds stopped."""
    hooks: ExperimentHooks = experiment.hooks
    judge = hooks.judge
    rounds = Rounds(
        list(result.arms),
        fixed=experiment.fixed,
        stopping=experiment.stopping,
        decide=(lambda _done: judge(result)) if judge is not None else None,
    )
    previous: ExperimentRun | None = None
    position = done = 0
    try:
        while rounds.another(done):
            began = time.monotonic()
            for arm in rounds.order(done + 1):
                position += 1
                run = experiment.run_for(done + 1, arm)
                try:
                    one(run, previous, position)
                except RunFailed as exc:
                    result.status, result.failure = "failed", str(exc)
                    return
                if not result.record(run):
                    return
                previous = run
            done += 1
            look = rounds.finished(done, time.monotonic() - began)
            if look is not None:
                hooks.looked(done, look)
            if rounds.growth is not None and rounds.stopping and done == rounds.stopping.first:
                experiment.config = experiment.config.grown(rounds.growth)
    except KeyboardInterrupt:
        result.status = "partial"
    finally:
        result.stopped = rounds.stopped or "interrupted"
        result.stop_words = rounds.words()
        result.sizing = rounds.sizing
        result.looks = list(rounds.looks)
        result.order = " ".join(
            chr(ord("A") + result.arms.index(r.arm)) for r in result.runs if r.arm in result.arms
        )
