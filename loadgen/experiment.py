"""Lever-flip experiments: one seeded workload against two or more server profiles (arms).

Every arm runs `repeats` times (3 by default), interleaved A B B A A B …: odd repeats in the
spec's order, even ones reversed, so a linear drift of the machine (a neighbour's load, a
warming cache, thermal throttling) lands on every arm alike instead of favouring the later one.
At every switch of arm a `lever_flips` row records what changed, which is what reports split on
and dashboards annotate. An A/A spec (one profile twice, e.g. the `aa` experiment) measures the
noise floor: its arms get distinct names (`default-a`, `default-b`) and record no lever flip.

How the servers and rounds are sequenced (`design`, recorded in every run's notes):

- `servers kept up` (CPU profiles, the default): one vLLM per arm, all started at once, each on
  its own port with its own log and its own collector sidecar; rounds alternate between them,
  and each round begins with the arm's prefix cache emptied (vLLM's `POST /reset_prefix_cache`,
  served with `VLLM_SERVER_DEV_MODE=1`), so every repeat starts from the same cache state
  without paying a start per repeat.
- `servers kept up asleep in turn` (GPU profiles, the default there): one vLLM per arm, as
  above, but two servers that each take most of the GPU's memory cannot both be awake, and a
  fresh start costs 90-150 s a run. So each arm's server starts once, one after the other
  (vLLM sizes its KV cache from the memory free at its start, so the one before is put to
  sleep first), with `--enable-sleep-mode`; before a run, the server awake is put to sleep
  (level 1: weights offloaded to CPU memory, KV cache discarded, prefix cache emptied) and the
  run's arm is woken (weights copied back, KV cache mapped again), then its prefix cache is
  reset as above. A run's notes say how long the sleep and the wake took (`sleep_s`,
  `wake_s`).
- `fresh server per run` (`fresh_servers=True`): every run starts its own vLLM, all on one
  port appending to one log with one sidecar, as a server an operator restarts with other
  flags does.
- `operator's servers` (`--target ARM=URL`): the user's servers, which cannot be restarted;
  their prefix cache is reset where they serve the dev-mode endpoint, else the run's notes say
  that it started warm.

A sidecar (servescope wires the collector in) watches the servers from outside, so every bench
run is joined with vLLM's own timings.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Protocol

import msgspec

from servescope.loadgen.launcher import (
    ALWAYS_FLAGS,
    Profile,
    VllmServer,
    levers_of,
    load_profiles,
    read_section,
    state_for,
)
from servescope.loadgen.rounds import Look, Rounds, Stopping, round_arms
from servescope.loadgen.runner import RunResult
from servescope.loadgen.workload import BenchConfig, WorkloadError, load_config
from servescope.store import Store, settings
from servescope.store.typed import Named, typed

EXPERIMENTS_FILE = Path(__file__).with_name("experiments.yaml")
DEFAULT_LEVER = "default"  # a lever a profile leaves to vLLM's own default
DEFAULT_REPEATS = 3  # rounds of a fixed design when no stopping plan is given
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}  # vLLM serves POST /reset_prefix_cache only then
# … and POST /sleep, /wake_up, GET /is_sleeping with this flag, which also makes it allocate the
# weights and the KV cache where a sleep can release them (its cumem allocator)
SLEEP_FLAGS = ["--enable-sleep-mode"]
# level 1: the weights offloaded to CPU memory (a wake copies them back), the KV cache dropped;
# level 2 drops the weights too, and a wake would have to load them again
SLEEP_LEVEL = 1

# notes["repeat_design"]: how the experiment sequenced servers and rounds
KEPT_UP = "servers kept up: one server per arm, all up at once, rounds alternated"
SLEEP = (
    "servers kept up asleep in turn: one server per arm, started one after the other, the "
    "arm that runs awake and the others asleep (vLLM sleep level 1), rounds alternated"
)
FRESH = "fresh server per run"
TARGETS = "operator's servers (--target): kept up, rounds alternated"
FLEET = "replicas kept up: one gateway per run, rounds alternated"
# notes["repeat_state"]: the state a run's server started it in
STATE_FRESH = "fresh server"
STATE_RESET = "prefix cache reset"
STATE_WOKEN = "woken from sleep, prefix cache reset"
STATE_WARM = "warm: not reset (a --target server without dev mode)"
STATE_REFUSED = "warm: prefix cache reset refused (blocks still in use)"


class ExperimentError(WorkloadError):
    """An experiments file (or a spec in it) that cannot be run; the message says where."""


@dataclass(frozen=True)
class FleetSpec:
    """Replicas behind the gateway (loadgen/fleet.py): how many, their server profile and, for
    one replica a GPU, the `CUDA_VISIBLE_DEVICES` of each (`gpus`, one entry a replica)."""

    replicas: int
    profile: str
    gpus: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExperimentSpec:
    name: str
    description: str
    workload: str
    profiles: list[str]
    workloads: list[str] = field(default_factory=list)
    scale: float = 1.0
    requests: int | None = None
    model: str = "random"  # a tiny model kind (loadgen/tiny_model.py KINDS), or a model folder
    fleet: FleetSpec | None = None  # set: `profiles` are the gateway's routing policies
    repeats: int | None = None  # a fixed design's rounds; None: until decided (loadgen/rounds.py)
    source: str = "built-in"  # the experiments file it came from

    @property
    def arms(self) -> list[str]:
        return arm_names(self.profiles)

    def bench_config(self, scale: float | None, requests: int | None) -> BenchConfig:
        """The workload every run of the experiment sends: the spec's workloads, with the
        command line's request count and scale over the spec's own."""
        config = load_config(self.workload)
        if self.workloads:
            config = config.select(self.workloads)
        requests = requests if requests is not None else self.requests
        if requests is not None:
            config = config.with_requests(requests)  # WorkloadError below 1
        return config.scaled(scale if scale is not None else self.scale)


def arm_names(profiles: list[str]) -> list[str]:
    """An arm per profile, named after it; a profile named more than once (an A/A spec) gives
    arms `<profile>-a`, `<profile>-b`, … so that runs and reports stay apart."""
    counts = {p: profiles.count(p) for p in profiles}
    seen: dict[str, int] = {}
    names = []
    for profile in profiles:
        if counts[profile] == 1:
            names.append(profile)
            continue
        seen[profile] = seen.get(profile, 0) + 1
        names.append(f"{profile}-{chr(ord('a') + seen[profile] - 1)}")
    return names


def interleaved(arms: list[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, arm) in run order: A B, B A, A B, … (three arms: A B C, C B A, …)."""
    return [(r, arm) for r in range(1, repeats + 1) for arm in round_arms(arms, r)]


def order_letters(arms: list[str], repeats: int) -> str:
    """The run order as letters, e.g. "A B B A A B" (A = the first arm of the spec)."""
    letter = {arm: chr(ord("A") + i) for i, arm in enumerate(arms)}
    return " ".join(letter[arm] for _repeat, arm in interleaved(arms, repeats))


# -- experiments files ---------------------------------------------------------------------

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Name = Annotated[str, msgspec.Meta(min_length=1)]


class FleetEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An experiment's `fleet` as the file writes it."""

    replicas: PositiveInt
    profile: str
    gpus: list[str] = []


class ExperimentEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An experiment as an experiments file writes it (a key null is a key left out where
    that has a meaning: no `requests`, no `workloads`, no `fleet`)."""

    workload: Name
    profiles: list[Name]
    description: str = ""
    workloads: list[str] | None = None
    scale: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    requests: PositiveInt | None = None
    model: str = "random"
    fleet: FleetEntry | None = None
    repeats: PositiveInt | None = None


def _spec(name: str, raw: Any, source: Path) -> ExperimentSpec:
    entry = typed(
        raw, ExperimentEntry, str(source), error=ExperimentError, at=[Named("experiment", name)]
    )
    where = f"{source}: experiment {name!r}"
    if len(entry.profiles) < 2:
        raise ExperimentError(
            f"{where}: `profiles` must list at least two profiles (the first is the before; "
            "name one twice for an A/A run)"
        )
    fleet = None
    if entry.fleet is not None:
        replicas, gpus = entry.fleet.replicas, entry.fleet.gpus
        if gpus and len(gpus) != replicas:
            raise ExperimentError(
                f"{where}: `fleet.gpus` is one CUDA_VISIBLE_DEVICES value a replica "
                f'({replicas}), e.g. ["0", "1"]'
            )
        fleet = FleetSpec(replicas, entry.fleet.profile, tuple(gpus))
    workload, model = entry.workload, entry.model
    if source != EXPERIMENTS_FILE:  # an operator's paths are relative to their file
        workload = _beside(source, workload)
        model = _beside(source, model)
    return ExperimentSpec(
        name=name,
        description=" ".join(entry.description.split()),
        workload=workload,
        profiles=list(entry.profiles),
        workloads=list(entry.workloads or []),
        scale=entry.scale,
        requests=entry.requests,
        model=model,
        fleet=fleet,
        repeats=entry.repeats,
        source="built-in" if source == EXPERIMENTS_FILE else str(source),
    )


def _beside(source: Path, value: str) -> str:
    """A relative path of an operator's file as it is from their file's folder, where one is
    there (a shipped workload's or a tiny model kind's name stays as it is)."""
    path = Path(value)
    if path.is_absolute() or not (source.parent / path).exists():
        return value
    return str(source.parent / path)


def read_experiments_file(path: Path) -> dict[str, ExperimentSpec]:
    """One experiments file's specs; ExperimentError names the file and what is wrong."""
    section = read_section(path, "experiments", ExperimentError)
    return {str(name): _spec(str(name), raw, Path(path)) for name, raw in section.items()}


def load_experiments(path: Path | None = None) -> dict[str, ExperimentSpec]:
    """The built-in experiments, with those of `path` (an operator's file in the same format)
    added over them: one of theirs replaces a built-in one of the same name."""
    experiments = read_experiments_file(EXPERIMENTS_FILE)
    if path is not None:
        experiments.update(read_experiments_file(path))
    return experiments


def check_profiles(spec: ExperimentSpec, profiles: dict[str, Profile]) -> None:
    """ExperimentError when a spec names a profile the profiles do not define."""
    named = [spec.fleet.profile] if spec.fleet else spec.profiles
    if unknown := sorted({p for p in named if p not in profiles}):
        raise ExperimentError(
            f"experiment {spec.name}: unknown profiles {unknown}; known: {', '.join(profiles)}"
        )


def lever_flips(before: dict[str, Any], after: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(lever, before, after) for every lever whose value differs; a lever one side leaves
    unset is `default` (vLLM's own default) on that side."""
    flips = []
    for lever in sorted(set(before) | set(after)):
        old, new = before.get(lever, DEFAULT_LEVER), after.get(lever, DEFAULT_LEVER)
        if old != new:
            flips.append((lever, str(old), str(new)))
    return flips


def start_together(servers: list[VllmServer]) -> None:
    """Start servers at once, each waiting for its own /health. The first that fails (or a
    Ctrl-C) stops them all, so no start-up is waited out for nothing."""
    pool = ThreadPoolExecutor(max_workers=max(1, len(servers)))
    try:
        futures = [pool.submit(server.start) for server in servers]
        for future in futures:
            future.result()
    except BaseException:
        for server in servers:
            server.stop()  # a start still waiting sees its process gone and returns
        raise
    finally:
        pool.shutdown(wait=True)


class ResetUnavailable(RuntimeError):
    """The server does not serve `POST /reset_prefix_cache` (vLLM without dev mode)."""


def reset_prefix_cache(url: str, *, attempts: int = 20, wait_s: float = 0.25) -> str:
    """Empty the prefix cache of the vLLM at `url`, so a run starts cold without a restart.
    Returns the state the run starts in: STATE_RESET, or STATE_REFUSED when vLLM kept saying
    `success: false` (blocks still held); ResetUnavailable when it has no such endpoint."""
    for _ in range(attempts):
        request = urllib.request.Request(f"{url}/reset_prefix_cache", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                body = resp.read()
        except urllib.error.HTTPError as exc:
            if exc.code in (404, 405):
                raise ResetUnavailable(f"{url} has no /reset_prefix_cache ({exc.code})") from exc
            raise
        try:
            answer = json.loads(body or b"{}")
        except ValueError:
            answer = {}
        if not isinstance(answer, dict) or answer.get("success", True):
            return STATE_RESET  # older vLLMs answer 200 with no body
        time.sleep(wait_s)
    return STATE_REFUSED


class SleepFailed(RuntimeError):
    """A server that would not go to sleep or wake up (no `--enable-sleep-mode`, no dev mode,
    or vLLM refused); the message says which and what it answered."""


def is_sleeping(url: str) -> bool:
    """What the vLLM at `url` says of itself (`GET /is_sleeping`)."""
    try:
        with urllib.request.urlopen(f"{url}/is_sleeping", timeout=30) as resp:
            answer = json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        raise SleepFailed(f"{url}/is_sleeping answered {exc.code}") from exc
    if not isinstance(answer, dict) or not isinstance(answer.get("is_sleeping"), bool):
        raise SleepFailed(f"{url}/is_sleeping answered {answer!r}")
    return answer["is_sleeping"]


def set_sleeping(
    url: str,
    asleep: bool,
    *,
    level: int = SLEEP_LEVEL,
    timeout_s: float = 300.0,
    poll_s: float = 0.1,
) -> float:
    """Put the vLLM at `url` to sleep at `level` (`POST /sleep`) or wake it (`POST /wake_up`,
    all of its memory), and return the seconds until it said it was so (`GET /is_sleeping`).
    vLLM answers both once its engine has done it; the look that follows is what proves it,
    since an older engine answered before it was done. SleepFailed when it refuses, lacks the
    endpoints or never gets there."""
    path = f"sleep?level={level}" if asleep else "wake_up"
    began = time.monotonic()
    request = urllib.request.Request(f"{url}/{path}", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            resp.read()
    except urllib.error.HTTPError as exc:
        raise SleepFailed(
            f"{url}/{path} answered {exc.code}: sleep mode needs --enable-sleep-mode and "
            "VLLM_SERVER_DEV_MODE=1"
        ) from exc
    while is_sleeping(url) != asleep:
        if time.monotonic() - began > timeout_s:
            state = "asleep" if asleep else "awake"
            raise SleepFailed(f"{url} not {state} {timeout_s:.0f} s after POST /{path}")
        time.sleep(poll_s)
    return time.monotonic() - began


@dataclass
class ExperimentRun:
    profile: str
    repeat: int
    run_id: str
    levers: dict[str, Any]
    target: str
    result: RunResult | None = None
    server_ready_s: float | None = None
    arm: str = ""  # the arm's name: the profile's, or `<profile>-a` in an A/A experiment
    notes: dict[str, Any] = field(default_factory=dict)

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


@dataclass
class ExperimentHooks:
    """What a display needs: called before a server starts, when it is ready, when one is put to
    sleep or woken (its arm, the seconds it took), and at each look at the evidence; the sidecar
    to start next to the servers, if any; and `judge`, which reads the evidence of the runs so
    far (the pooled comparisons, by the stopping rule) for a sequential design."""

    starting: Callable[[str, VllmServer], None] = lambda profile, server: None
    ready: Callable[[str, VllmServer], None] = lambda profile, server: None
    slept: Callable[[str, float], None] = lambda arm, seconds: None
    woke: Callable[[str, float], None] = lambda arm, seconds: None
    looked: Callable[[int, Look], None] = lambda done, look: None
    sidecar: SidecarFactory | None = None
    judge: Callable[[ExperimentResult], Look] | None = None


# (config, target, store, run options) -> the run's result
Executor = Callable[[BenchConfig, str, Store, dict[str, Any]], RunResult]


@dataclass
class Comparison:
    """Two consecutive arms of the spec (before, after) and the runs of each, in run order."""

    before: str
    after: str
    before_runs: list[ExperimentRun]
    after_runs: list[ExperimentRun]


def run_notes(
    experiment: Any, run: ExperimentRun, position: int, order: str, design: str | None = None
) -> dict[str, Any]:
    """What every experiment run records in its notes: which experiment, arm and repeat, where
    it fell in the order, and how its servers were sequenced (`repeat_design`)."""
    return {
        "experiment": experiment.spec.name,
        "experiment_id": experiment.experiment_id,
        "profile": run.profile,
        "arm": run.arm,
        "repeat": run.repeat,
        "repeats": experiment.repeats,
        "position": position,
        "order": order,
        "repeat_design": design or experiment.design,
        **({"plan": experiment.stopping.notes()} if experiment.stopping else {}),
    }


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


class Experiment:
    """One experiment: the spec's workload against each arm, `repeats` times interleaved."""

    def __init__(
        self,
        spec: ExperimentSpec,
        *,
        store: Store,
        execute: Executor,
        model: Path,
        targets: dict[str, str] | None = None,
        repeats: int | None = None,
        scale: float | None = None,
        requests: int | None = None,
        slo: dict[str, float] | None = None,
        hooks: ExperimentHooks | None = None,
        server_flags: list[str] | None = None,
        profiles: dict[str, Profile] | None = None,
        fresh_servers: bool = False,
        stopping: Stopping | None = None,
    ) -> None:
        profiles = profiles if profiles is not None else load_profiles()
        check_profiles(spec, profiles)
        self.arms = spec.arms
        self.arm_profile = dict(zip(self.arms, spec.profiles, strict=True))
        if targets and (missing := [a for a in self.arms if a not in targets]):
            raise ExperimentError(
                f"experiment {spec.name}: no --target for arms {missing} "
                f"(give --target ARM=URL for each of {', '.join(self.arms)})"
            )
        if targets and (extra := sorted(set(targets) - set(self.arms))):
            raise ExperimentError(
                f"experiment {spec.name}: --target for {extra}, which is no arm of it "
                f"({', '.join(self.arms)})"
            )
        self.fixed, self.stopping = fixed_or_sequential(spec, repeats, stopping)
        self.repeats = self.fixed or (self.stopping.last if self.stopping else DEFAULT_REPEATS)
        self.spec = spec
        self.profiles = profiles
        self.store = store
        self.execute = execute
        self.model = model
        self.targets = targets
        self.slo = slo or {}
        self.hooks = hooks or ExperimentHooks()
        self.server_flags = list(server_flags or [])  # after every profile's own: they win
        self.config = spec.bench_config(scale, requests)
        gpu = any(profiles[p].device == "gpu" for p in spec.profiles)
        self.design = TARGETS if targets else FRESH if fresh_servers else SLEEP if gpu else KEPT_UP
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        self.experiment_id = f"exp-{stamp}-{spec.name}"
        self._stamp = stamp
        self._sidecars: dict[str, Sidecar] = {}  # per arm (kept up) or "" (one for all)
        self._servers: dict[str, VllmServer] = {}  # per arm, kept up
        self._served: dict[str, int] = {}  # runs each arm's server has served so far
        self._awake: str | None = None  # SLEEP: the arm whose server is awake, if any
        self._port: int | None = None

    def run(self) -> ExperimentResult:
        """Rounds of every arm in interleaved order until the design says stop (loadgen/
        rounds.py); stops at the first interrupted or failed run. The servers this started
        (and their sidecars) are stopped in any case."""
        result = ExperimentResult(
            self.spec.name, self.experiment_id, arms=list(self.arms), design=self.design
        )
        try:
            if self.design == KEPT_UP:
                self._start_all()
            elif self.design == SLEEP:
                self._start_in_turn()
            elif self.design == FRESH and self.hooks.sidecar is not None:
                self._port = settings.free_port()
                log = settings.logs_dir() / f"{self.experiment_id}.log"
                self._sidecars[""] = self.hooks.sidecar(log, f"http://127.0.0.1:{self._port}")
            self._runs(result)
        except KeyboardInterrupt:
            result.status = "partial"
        except Exception as exc:  # a server (or a sidecar) that did not start
            result.status, result.failure = "failed", str(exc)
        finally:
            for server in self._servers.values():
                server.stop()
            for sidecar in self._sidecars.values():
                sidecar.close()
        return result

    def _server(self, arm: str, port: int, log: Path | None, sidecar: Sidecar | None) -> VllmServer:
        kept = self.design in (KEPT_UP, SLEEP)
        return VllmServer(
            self.model,
            profile=self.profiles[self.arm_profile[arm]],
            port=port,
            extra_flags=(SLEEP_FLAGS if self.design == SLEEP else [])
            + self.server_flags
            + (sidecar.flags if sidecar else []),
            env={**(DEV_MODE if kept else {}), **(sidecar.env if sidecar else {})},
            log_path=log,
        )

    def _arm_servers(self) -> None:
        """One server per arm, each with its own port, log and sidecar (started first: it
        receives the server's traces from its first request); none started yet."""
        for arm in self.arms:
            port = settings.free_port()
            log = settings.logs_dir() / f"{self.experiment_id}-{arm}.log"
            sidecar = None
            if self.hooks.sidecar is not None:
                sidecar = self._sidecars[arm] = self.hooks.sidecar(log, f"http://127.0.0.1:{port}")
            self._servers[arm] = self._server(arm, port, log, sidecar)

    def _start_all(self) -> None:
        """The arms' servers, all starting at once."""
        self._arm_servers()
        for arm, server in self._servers.items():
            self.hooks.starting(arm, server)
        start_together(list(self._servers.values()))
        for arm, server in self._servers.items():
            self.hooks.ready(arm, server)

    def _start_in_turn(self) -> None:
        """The arms' servers one after the other, each put to sleep before the next starts:
        vLLM sizes its KV cache from the GPU memory free at its start, so two starting together
        would each count the other's memory as theirs. The first round's first arm starts
        last and stays awake, so the rounds begin without a switch."""
        self._arm_servers()
        for arm in reversed(self.arms):
            if self._awake is not None:
                self._sleep(self._awake)
            server = self._servers[arm]
            self.hooks.starting(arm, server)
            server.start()
            self.hooks.ready(arm, server)
            self._awake = arm

    def _sleep(self, arm: str) -> float:
        seconds = set_sleeping(self._servers[arm].url, asleep=True)
        self._awake = None
        self.hooks.slept(arm, seconds)
        return seconds

    def _wake(self, arm: str) -> dict[str, float]:
        """Make `arm`'s server the one awake: the one awake put to sleep first (a level-1 sleep
        frees its weights and KV cache, which the woken one takes back), then this one woken.
        The seconds each took, as the run's notes keep them; none when it was awake already."""
        if self._awake == arm:
            return {}
        timings: dict[str, float] = {}
        if self._awake is not None:
            timings["sleep_s"] = round(self._sleep(self._awake), 3)
        seconds = set_sleeping(self._servers[arm].url, asleep=False)
        self._awake = arm
        self.hooks.woke(arm, seconds)
        timings["wake_s"] = round(seconds, 3)
        return timings

    def _runs(self, result: ExperimentResult) -> None:
        def one(run: ExperimentRun, previous: ExperimentRun | None, position: int) -> None:
            try:
                self._one(run, previous, position)
            except KeyboardInterrupt:
                raise
            except Exception as exc:  # a server that did not start, a target that is gone
                raise RunFailed(f"{run.arm}: {exc}") from exc

        run_rounds(self, result, one)

    def _one(self, run: ExperimentRun, previous: ExperimentRun | None, position: int) -> None:
        run.notes = run_notes(self, run, position, order_letters(self.arms, self.repeats))
        if self.design == FRESH:
            self._fresh(run, previous)
            return
        if self.targets:
            run.target = self.targets[run.arm]
            state = state_for(run.target)
            run.levers = state.levers if state else self._profile_levers(run.profile)
        else:
            server = self._servers[run.arm]
            run.target, run.levers, run.server_ready_s = server.url, server.levers, server.ready_s
        woken = self._wake(run.arm) if self.design == SLEEP else {}
        run.notes.update(woken)
        reset = self._reset(run.target)
        run.notes["repeat_state"] = STATE_WOKEN if woken and reset == STATE_RESET else reset
        run.notes["server_runs_before"] = self._served.get(run.arm, 0)
        self._served[run.arm] = self._served.get(run.arm, 0) + 1
        self._execute(run, previous, self._sidecars.get(run.arm))

    def _reset(self, url: str) -> str:
        try:
            return reset_prefix_cache(url)
        except ResetUnavailable:
            if self.targets:
                return STATE_WARM
            raise

    def _fresh(self, run: ExperimentRun, previous: ExperimentRun | None) -> None:
        sidecar = self._sidecars.get("")
        server = self._server(
            run.arm,
            self._port or settings.free_port(),
            settings.logs_dir() / f"{self.experiment_id}.log" if sidecar else None,
            sidecar,
        )
        run.target, run.levers = server.url, server.levers
        run.notes["repeat_state"] = STATE_FRESH
        run.notes["server_runs_before"] = 0
        self.hooks.starting(run.arm, server)
        try:
            server.start()
            run.server_ready_s = server.ready_s
            self.hooks.ready(run.arm, server)
            self._execute(run, previous, sidecar)
        finally:
            server.stop()

    def _execute(
        self, run: ExperimentRun, previous: ExperimentRun | None, sidecar: Sidecar | None
    ) -> None:
        record_flips(self.store, self.spec.name, run, previous)
        options: dict[str, Any] = {
            "run_id": run.run_id,
            "label": run.arm,
            "slo": self.slo,
            "notes": run.notes,
        }
        run.result = self.execute(self.config, run.target, self.store, options)
        if sidecar is not None:
            sidecar.settle(run.run_id)

    def run_for(self, repeat: int, arm: str) -> ExperimentRun:
        """The run of `arm` in round `repeat`, before it is made."""
        return ExperimentRun(
            profile=self.arm_profile[arm],
            repeat=repeat,
            run_id=f"run-{self._stamp}-{self.spec.name}-{arm}-r{repeat}",
            levers={},
            target="",
            arm=arm,
        )

    def _profile_levers(self, profile: str) -> dict[str, Any]:
        return levers_of(ALWAYS_FLAGS + self.profiles[profile].flags)


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
        decide=(lambda done: judge(result)) if judge is not None else None,
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
