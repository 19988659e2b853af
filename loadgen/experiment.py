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

from pathlib import Path
from typing import Unpack

from servescope.loadgen.launcher import (
    ALWAYS_FLAGS,
    Levers,
    VllmServer,
    levers_of,
    load_profiles,
    state_for,
)
from servescope.loadgen.runner import RunOptions
from servescope.loadgen.sequence import (
    ExperimentBase,
    ExperimentOptions,
    ExperimentResult,
    ExperimentRun,
    RunFailed,
    Sidecar,
    order_letters,
    record_flips,
    run_notes,
    run_rounds,
)
from servescope.loadgen.servers import (
    DEV_MODE,
    SLEEP_FLAGS,
    STATE_FRESH,
    STATE_RESET,
    STATE_WARM,
    STATE_WOKEN,
    ResetUnavailable,
    reset_prefix_cache,
    set_sleeping,
    start_together,
)
from servescope.loadgen.spec import (
    ExperimentError,
    ExperimentSpec,
    check_profiles,
)
from servescope.store import settings
from servescope.store.notes import RunNotes

# notes["repeat_design"]: how the experiment sequenced servers and rounds
KEPT_UP = "servers kept up: one server per arm, all up at once, rounds alternated"
SLEEP = (
    "servers kept up asleep in turn: one server per arm, started one after the other, the "
    "arm that runs awake and the others asleep (vLLM sleep level 1), rounds alternated"
)
FRESH = "fresh server per run"
TARGETS = "operator's servers (--target): kept up, rounds alternated"
FLEET = "replicas kept up: one gateway per run, rounds alternated"


class Experiment(ExperimentBase):
    """One experiment: the spec's workload against each arm, `repeats` times interleaved."""

    def __init__(
        self,
        spec: ExperimentSpec,
        *,
        targets: dict[str, str] | None = None,
        server_flags: list[str] | None = None,
        fresh_servers: bool = False,
        **options: Unpack[ExperimentOptions],
    ) -> None:
        profiles = options.get("profiles")
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
        super().__init__(spec, options)
        self.profiles = profiles
        self.targets = targets
        self.server_flags = list(server_flags or [])  # after every profile's own: they win
        gpu = any(profiles[p].device == "gpu" for p in spec.profiles)
        self.design = TARGETS if targets else FRESH if fresh_servers else SLEEP if gpu else KEPT_UP
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
        except (RuntimeError, OSError, ValueError) as exc:  # a server or sidecar that did not start
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

    def _wake(self, arm: str) -> RunNotes:
        """Make `arm`'s server the one awake: the one awake put to sleep first (a level-1 sleep
        frees its weights and KV cache, which the woken one takes back), then this one woken.
        The seconds each took, as the run's notes keep them; none when it was awake already."""
        if self._awake == arm:
            return {}
        timings: RunNotes = {}
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
        # the levers the experiment set, not what a state file on disk says of the port
        options = RunOptions(
            run_id=run.run_id, label=run.arm, slo=self.slo, notes=run.notes, levers=run.levers
        )
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

    def _profile_levers(self, profile: str) -> Levers:
        return levers_of(ALWAYS_FLAGS + self.profiles[profile].flags)
