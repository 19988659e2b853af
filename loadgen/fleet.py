"""A fleet experiment: several vLLM replicas behind the gateway, one routing policy per run.

The `routing` experiment (loadgen/experiments.yaml) flips the gateway's routing policy, not a
server flag: its `profiles` are routing policies and its `fleet` names how many replicas to
start and with which server profile. The replicas start once (two vLLMs on a CPU take minutes)
and every run begins with their prefix caches emptied (vLLM's `POST /reset_prefix_cache`, served
with `VLLM_SERVER_DEV_MODE=1`), so each run starts cold as it would on fresh servers; repeats are
interleaved A B B A … as in every experiment (loadgen/experiment.py). Each run
gets a fresh `servescope gateway` (its own process, so the proxy's CPU is not the load
generator's) with a pool of the replicas and the run's policy; bench sends through it and
scrapes every replica's `/metrics` into the run (`bench run --replica`), so the report has its
per-replica table. The run's `levers` are the replicas' flags plus `routing`; at every switch
a `lever_flips` row records the change of `routing`, as for any lever. With a sidecar in the
hooks (as `servescope experiment run` gives), each replica gets its own collector, as an
operator runs one per server: vLLM's log, traces and `/metrics`, and the GPU on a GPU server.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Unpack

import yaml

from servescope.loadgen.experiment import FLEET
from servescope.loadgen.launcher import Levers, VllmServer, load_profiles
from servescope.loadgen.runner import RunOptions
from servescope.loadgen.sequence import (
    ExperimentBase,
    ExperimentOptions,
    ExperimentResult,
    ExperimentRun,
    Sidecar,
    order_letters,
    record_flips,
    run_notes,
    run_rounds,
)
from servescope.loadgen.servers import DEV_MODE, STATE_REFUSED, reset_prefix_cache, start_together
from servescope.loadgen.spec import ExperimentSpec
from servescope.loadgen.workload import WorkloadError
from servescope.store import Store, settings
from servescope.wire.routing import ROUTING_POLICIES


class GatewayFailed(RuntimeError):
    """The gateway of a run did not start; the message carries its log."""


def key_variable(team: str) -> str:
    """The environment variable bench reads a team's key from (loadgen.schedule.team_headers)."""
    return "SERVESCOPE_KEY_" + re.sub(r"[^A-Za-z0-9]", "_", team).upper()


def gateway_config(
    replicas: dict[str, VllmServer], model: str, policy: str, keys: dict[str, str], events: Path
) -> dict[str, Any]:
    """gateway.yaml for one run: the replicas as a pool of `model` routed by `policy`, one team
    per workload team (limits wide enough to admit the whole workload at once)."""
    return {
        "events_dir": str(events),
        "upstreams": {
            name: {"url": server.url, "model": server.served_name, "max_concurrent": 64}
            for name, server in replicas.items()
        },
        "models": {model: {"pool": list(replicas), "routing": policy}},
        "teams": {
            team: {"keys": [key], "max_concurrent": 64, "max_queue": 256}
            for team, key in keys.items()
        },
    }


class GatewayProcess:
    """`servescope gateway` for one run: started on a free port, stopped with SIGTERM."""

    def __init__(self, config: dict[str, Any], folder: Path, store: Store) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.config_path = folder / "gateway.yaml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log_path = folder / "gateway.log"
        self.port = settings.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.store = store
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> GatewayProcess:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "servescope.cli",
                    "gateway",
                    "--config",
                    str(self.config_path),
                    "--port",
                    str(self.port),
                    "--store",
                    str(self.store.path),
                ],  # fmt: skip
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1):
                    return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.1)
        self.stop()
        raise GatewayFailed(f"the gateway did not start; log {self.log_path}:\n{self._tail()}")

    def _tail(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)


def _overlap(gpus: tuple[str, ...]) -> bool:
    """Whether two replicas' CUDA_VISIBLE_DEVICES values name a GPU in common."""
    seen: set[str] = set()
    for value in gpus:
        names = {g.strip() for g in value.split(",") if g.strip()}
        if names & seen:
            return True
        seen |= names
    return False


class FleetExperiment(ExperimentBase):
    """The spec's workload through the gateway to `fleet.replicas` replicas, once per routing
    policy in `profiles`, `repeats` times interleaved (A B B A …)."""

    def __init__(self, spec: ExperimentSpec, **options: Unpack[ExperimentOptions]) -> None:
        if spec.fleet is None:
            raise WorkloadError(f"experiment {spec.name}: no `fleet` to start")
        if unknown := [p for p in spec.profiles if p not in ROUTING_POLICIES]:
            raise WorkloadError(
                f"experiment {spec.name}: {unknown} are not routing policies "
                f"({', '.join(ROUTING_POLICIES)})"
            )
        if len(set(spec.profiles)) < len(spec.profiles):
            raise WorkloadError(f"experiment {spec.name}: a routing policy named twice")
        profiles = options.get("profiles")
        profiles = profiles if profiles is not None else load_profiles()
        if spec.fleet.profile not in profiles:
            raise WorkloadError(f"experiment {spec.name}: unknown profile {spec.fleet.profile}")
        super().__init__(spec, options)
        self.profile = profiles[spec.fleet.profile]
        self.design = FLEET
        self.folder = settings.fleet_dir() / self.experiment_id
        teams = sorted({w.team for w in self.config.workloads if w.team})
        self.keys = {team: f"sk-{secrets.token_hex(16)}" for team in teams}
        self._sidecars: list[Sidecar] = []
        self._levers: Levers = {}

    def run(self) -> ExperimentResult:
        """Start the replicas (and their sidecars), run every (repeat, policy), stop them all."""
        result = ExperimentResult(
            self.spec.name,
            self.experiment_id,
            arms=list(self.spec.profiles),
            design=FLEET,
        )
        replicas: dict[str, VllmServer] = {}
        saved = {var: os.environ.get(var) for var in map(key_variable, self.keys)}
        os.environ.update({key_variable(team): key for team, key in self.keys.items()})
        try:
            replicas = self._replicas()
            self._start(replicas)
            self._runs(replicas, result)
        except KeyboardInterrupt:
            result.status = "partial"
        except (RuntimeError, OSError, ValueError) as exc:  # a replica or gateway not started
            result.status, result.failure = "failed", str(exc)
        finally:
            for server in replicas.values():
                server.stop()
            for sidecar in self._sidecars:
                sidecar.close()
            for var, value in saved.items():
                if value is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = value
        return result

    def _replicas(self) -> dict[str, VllmServer]:
        """One server per replica, each with its own collector sidecar when the hooks give one
        (started first: it receives the server's traces from the server's first request)."""
        assert self.spec.fleet is not None
        replicas: dict[str, VllmServer] = {}
        for i in range(self.spec.fleet.replicas):
            name, port = f"r{i + 1}", settings.free_port()
            log = settings.logs_dir() / f"{self.experiment_id}-{name}.log"
            sidecar = None
            if self.hooks.sidecar is not None:
                sidecar = self.hooks.sidecar(log, f"http://127.0.0.1:{port}")
                self._sidecars.append(sidecar)
            gpu = {"CUDA_VISIBLE_DEVICES": self.spec.fleet.gpus[i]} if self.spec.fleet.gpus else {}
            replicas[name] = VllmServer(
                self.model,
                profile=self.profile,
                port=port,
                served_name=Path(self.model).name,
                extra_flags=sidecar.flags if sidecar else None,
                env={**DEV_MODE, **gpu, **(sidecar.env if sidecar else {})},
                log_path=log,
            )
        return replicas

    def _start(self, replicas: dict[str, VllmServer]) -> None:
        """CPU replicas at once (each waits for its own /health), and GPU replicas that each
        have their own GPUs (`fleet.gpus`); GPU replicas that may share a device one after the
        other: vLLM sizes its KV cache from the device memory it sees in use while it profiles,
        and would count a neighbour's start-up as its own."""
        for name, server in replicas.items():
            self.hooks.starting(f"{name} ({server.profile.name})", server)
        gpus = self.spec.fleet.gpus if self.spec.fleet else ()
        own_gpus = bool(gpus) and not _overlap(gpus)
        if any(server.profile.device == "gpu" for server in replicas.values()) and not own_gpus:
            for server in replicas.values():
                server.start()
        else:
            start_together(list(replicas.values()))
        for name, server in replicas.items():
            self.hooks.ready(name, server)

    def _runs(self, replicas: dict[str, VllmServer], result: ExperimentResult) -> None:
        self._levers = next(iter(replicas.values())).levers

        def one(run: ExperimentRun, previous: ExperimentRun | None, position: int) -> None:
            order = order_letters(result.arms, self.repeats)
            run.notes = run_notes(self, run, position, order, FLEET)
            run.notes["server_runs_before"] = position - 1
            self._one(run, previous, replicas)

        run_rounds(self, result, one)

    def run_for(self, repeat: int, policy: str) -> ExperimentRun:
        """The run of routing policy `policy` in round `repeat`, before it is made."""
        return ExperimentRun(
            profile=policy,
            repeat=repeat,
            run_id=f"run-{self._stamp}-{self.spec.name}-{policy}-r{repeat}",
            levers={**self._levers, "routing": policy},
            target="",
        )

    def _one(
        self, run: ExperimentRun, previous: ExperimentRun | None, replicas: dict[str, VllmServer]
    ) -> None:
        states = {reset_prefix_cache(server.url) for server in replicas.values()}
        run.notes["repeat_state"] = STATE_REFUSED if STATE_REFUSED in states else states.pop()
        model = next(iter(replicas.values())).served_name
        config = gateway_config(
            replicas, model, run.profile, self.keys, self.folder / run.run_id / "events"
        )
        gateway = GatewayProcess(config, self.folder / run.run_id, self.store).start()
        try:
            run.target = gateway.url
            record_flips(self.store, self.spec.name, run, previous)
            options = RunOptions(
                run_id=run.run_id,
                label=run.profile,
                slo=self.slo,
                levers=run.levers,
                replicas={name: server.url for name, server in replicas.items()},
                notes={**run.notes, "gateway_config": str(gateway.config_path)},
            )
            run.result = self.execute(self.config, gateway.url, self.store, options)
            for sidecar in self._sidecars:
                sidecar.settle(run.run_id)
        finally:
            with contextlib.suppress(Exception):
                gateway.stop()
