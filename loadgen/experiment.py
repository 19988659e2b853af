"""Lever-flip experiments: one seeded workload against two or more server profiles.

Each profile gets a freshly started vLLM (so every run starts with cold caches; with `--target`
URLs the servers are the user's and cannot be restarted), warm-up requests, and one stored run
whose `levers` are the profile's flags. Repeats interleave (A B A B) so slow drift on the
machine spreads over both sides instead of favouring one. At every switch of profile a
`lever_flips` row records what changed, which is what reports split on and dashboards annotate.

A sidecar (servescope wires the collector in) can watch the servers from outside: then every
server of an experiment listens on one port and appends to one log, as a server an operator
restarts with other flags does, and every bench run is joined with vLLM's own timings.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import yaml

from servescope.loadgen.launcher import (
    ALWAYS_FLAGS,
    LOG_DIR,
    VllmServer,
    levers_of,
    load_profiles,
    state_for,
)
from servescope.loadgen.runner import RunResult
from servescope.loadgen.workload import BenchConfig, WorkloadError, load_config
from servescope.store import Store

EXPERIMENTS_FILE = Path(__file__).with_name("experiments.yaml")
DEFAULT_LEVER = "default"  # a lever a profile leaves to vLLM's own default


@dataclass(frozen=True)
class FleetSpec:
    """Replicas behind the gateway (loadgen/fleet.py): how many, and their server profile."""

    replicas: int
    profile: str


@dataclass(frozen=True)
class ExperimentSpec:
    name: str
    description: str
    workload: str
    profiles: list[str]
    workloads: list[str] = field(default_factory=list)
    scale: float = 1.0
    requests: int | None = None
    model: str = "random"  # the tiny model kind (loadgen/tiny_model.py KINDS) the servers load
    fleet: FleetSpec | None = None  # set: `profiles` are the gateway's routing policies

    def bench_config(self, scale: float | None, requests: int | None) -> BenchConfig:
        """The workload every run of the experiment sends: the spec's workloads, with the
        command line's request count and scale over the spec's own."""
        config = load_config(self.workload)
        if self.workloads:
            config = config.select(self.workloads)
        if requests := requests or self.requests:
            config = config.with_requests(requests)
        return config.scaled(scale if scale is not None else self.scale)


def load_experiments(path: Path = EXPERIMENTS_FILE) -> dict[str, ExperimentSpec]:
    raw: dict[str, dict[str, Any]] = yaml.safe_load(path.read_text())["experiments"]
    return {
        name: ExperimentSpec(
            name=name,
            description=" ".join(str(spec.get("description", "")).split()),
            workload=str(spec["workload"]),
            profiles=[str(p) for p in spec["profiles"]],
            workloads=[str(w) for w in spec.get("workloads") or []],
            scale=float(spec.get("scale", 1.0)),
            requests=spec.get("requests"),
            model=str(spec.get("model", "random")),
            fleet=FleetSpec(int(spec["fleet"]["replicas"]), str(spec["fleet"]["profile"]))
            if spec.get("fleet")
            else None,
        )
        for name, spec in raw.items()
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def lever_flips(before: dict[str, Any], after: dict[str, Any]) -> list[tuple[str, str, str]]:
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
    levers: dict[str, Any]
    target: str
    result: RunResult | None = None
    server_ready_s: float | None = None


class Sidecar(Protocol):
    """Something that watches the experiment's servers from outside: the vLLM flags and
    environment it needs, told when a run's requests are all answered, closed at the end."""

    flags: list[str]
    env: dict[str, str]

    def settle(self, run_id: str) -> None:
        """Return once what the servers said about the run's requests is stored."""

    def close(self) -> None: ...


# (the log every server of the experiment appends to, the URL they all listen on) -> a sidecar
SidecarFactory = Callable[[Path, str], Sidecar]


@dataclass
class ExperimentHooks:
    """What a display needs: called before a server starts and when it is ready; and the
    sidecar to start next to the servers, if any."""

    starting: Callable[[str, VllmServer], None] = lambda profile, server: None
    ready: Callable[[str, VllmServer], None] = lambda profile, server: None
    sidecar: SidecarFactory | None = None


# (config, target, store, run options) -> the run's result
Executor = Callable[[BenchConfig, str, Store, dict[str, Any]], RunResult]


@dataclass
class ExperimentResult:
    name: str
    experiment_id: str
    runs: list[ExperimentRun] = field(default_factory=list)
    status: str = "complete"  # complete | partial (Ctrl-C) | failed (a run failed or a server)
    failure: str | None = None

    def pairs(self) -> list[tuple[ExperimentRun, ExperimentRun]]:
        """(before, after) for every profile switch within a repeat."""
        out = []
        for previous, current in zip(self.runs, self.runs[1:], strict=False):
            if previous.repeat == current.repeat and current.result is not None:
                out.append((previous, current))
        return out


class Experiment:
    """One experiment: the spec's workload against each profile, `repeats` times."""

    def __init__(
        self,
        spec: ExperimentSpec,
        *,
        store: Store,
        execute: Executor,
        model: Path,
        targets: dict[str, str] | None = None,
        repeats: int = 1,
        scale: float | None = None,
        requests: int | None = None,
        slo: dict[str, float] | None = None,
        hooks: ExperimentHooks | None = None,
        server_flags: list[str] | None = None,
    ) -> None:
        profiles = load_profiles()
        if unknown := [p for p in spec.profiles if p not in profiles]:
            raise WorkloadError(f"experiment {spec.name}: unknown profiles {unknown}")
        if targets and (missing := [p for p in spec.profiles if p not in targets]):
            raise WorkloadError(f"experiment {spec.name}: no --target for profiles {missing}")
        self.spec = spec
        self.profiles = profiles
        self.store = store
        self.execute = execute
        self.model = model
        self.targets = targets
        self.repeats = repeats
        self.slo = slo or {}
        self.hooks = hooks or ExperimentHooks()
        self.server_flags = list(server_flags or [])  # after every profile's own: they win
        self.config = spec.bench_config(scale, requests)
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        self.experiment_id = f"exp-{stamp}-{spec.name}"
        self._stamp = stamp
        self._sidecar: Sidecar | None = None
        self._port: int | None = None

    def run(self) -> ExperimentResult:
        """Every (repeat, profile) in order; stops at the first interrupted or failed run."""
        if self.targets or self.hooks.sidecar is None:
            return self._runs()
        self._port = free_port()
        log = LOG_DIR / f"{self.experiment_id}.log"
        self._sidecar = self.hooks.sidecar(log, f"http://127.0.0.1:{self._port}")
        try:
            return self._runs()
        finally:
            self._sidecar.close()

    def _runs(self) -> ExperimentResult:
        result = ExperimentResult(self.spec.name, self.experiment_id)
        previous: ExperimentRun | None = None
        for repeat in range(1, self.repeats + 1):
            for profile in self.spec.profiles:
                run = ExperimentRun(
                    profile=profile,
                    repeat=repeat,
                    run_id=f"run-{self._stamp}-{self.spec.name}-{profile}-r{repeat}",
                    levers={},
                    target="",
                )
                try:
                    self._one(run, previous)
                except KeyboardInterrupt:
                    result.status = "partial"
                    return result
                except Exception as exc:  # a server that did not start, a target that is gone
                    result.status, result.failure = "failed", f"{profile}: {exc}"
                    return result
                result.runs.append(run)
                previous = run
                assert run.result is not None
                if run.result.status != "complete":
                    result.status = "partial" if run.result.status == "partial" else "failed"
                    result.failure = run.result.failure
                    return result
        return result

    def _one(self, run: ExperimentRun, previous: ExperimentRun | None) -> None:
        notes = {
            "experiment": self.spec.name,
            "experiment_id": self.experiment_id,
            "profile": run.profile,
            "repeat": run.repeat,
        }
        options: dict[str, Any] = {
            "run_id": run.run_id,
            "label": run.profile,
            "slo": self.slo,
            "notes": notes,
        }
        if self.targets:
            run.target = self.targets[run.profile]
            state = state_for(run.target)
            run.levers = state.levers if state else self._profile_levers(run.profile)
            self._flip(run, previous)
            run.result = self.execute(self.config, run.target, self.store, options)
            return
        sidecar = self._sidecar
        server = VllmServer(
            self.model,
            profile=run.profile,
            port=self._port or free_port(),
            extra_flags=self.server_flags + (sidecar.flags if sidecar else []),
            env=sidecar.env if sidecar else None,
            log_path=LOG_DIR / f"{self.experiment_id}.log" if sidecar else None,
        )
        run.target, run.levers = server.url, server.levers
        self.hooks.starting(run.profile, server)
        try:
            server.start()
            run.server_ready_s = server.ready_s
            self.hooks.ready(run.profile, server)
            self._flip(run, previous)
            run.result = self.execute(self.config, server.url, self.store, options)
            if sidecar is not None:
                sidecar.settle(run.run_id)
        finally:
            server.stop()

    def _profile_levers(self, profile: str) -> dict[str, Any]:
        return levers_of(ALWAYS_FLAGS + self.profiles[profile].flags)

    def _flip(self, run: ExperimentRun, previous: ExperimentRun | None) -> None:
        if previous is None:
            return
        for lever, before, after in lever_flips(previous.levers, run.levers):
            self.store.add_lever_flip(
                lever,
                before,
                after,
                run_id=run.run_id,
                note=f"experiment {self.spec.name}: {previous.profile} -> {run.profile}",
            )
