"""vLLM server sessions: one run per server lifetime, from its start-up lines to its shutdown.

A log file appended across restarts holds several sessions; each start is announced by the
version banner, then `non-default args: {…}` (the levers, the served model, the port), then
`Starting vLLM server on URL`. A session is named once its model and port are known:
`vllm-<served model>-<instance>-<port>-<UTC start>` (the instance, the collector's host by
default, keeps two nodes that start the same model on the same port in the same second apart in
a shared store or lake; the port keeps two servers of one host apart, as on MIG slices started
together). A collector given no instance (the library's default) names sessions as servescope
did before instances, `vllm-<served model>-<port>-<UTC start>`, and a session begun under that
name keeps it. Requests vLLM gave its own id belong to the session's run; a restart with other
levers is one `lever_flips` row per changed lever, between the two runs, and only between two
sessions of one instance.

Everything a session knows is plain data (`Session.state()`), checkpointed with the log offsets
it was read up to, so a collector killed and restarted resumes the same session. Which session
each thing the collector reads belongs to is collector/attribution.py's job.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import PurePath
from typing import Any, TypedDict
from urllib.parse import urlparse

from servescope.store import settings
from servescope.store.clock import iso, naive_utc, utcnow
from servescope.store.notes import SESSION_KIND, EngineNotes, KvStatement, ParallelNotes, RunNotes
from servescope.store.validation import EventDoc
from servescope.wire import vllm_log

DEFAULT_PORT = settings.VLLM_PORT
LABEL = "vLLM server session"
KIND = SESSION_KIND
# `vllm:cache_config_info` labels that are server flags (label → flag name); the other labels
# are consequences (KV-cache size, block counts) kept in the run's notes, not levers.
CACHE_LEVERS = {
    "enable_prefix_caching": "enable_prefix_caching",
    "block_size": "block_size",
    "cache_dtype": "kv_cache_dtype",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "prefix_caching_hash_algo": "prefix_caching_hash_algo",
    "num_gpu_blocks_override": "num_gpu_blocks_override",
    "kv_offloading_backend": "kv_offloading_backend",
    "kv_offloading_size": "kv_offloading_size",
}
CACHE_FLAGS = frozenset(CACHE_LEVERS.values())
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_NUMBER = re.compile(r"^-?\d+(\.\d+)?([eE][-+]?\d+)?$")

# A server's configuration, flag name → value as `non-default args` writes it (vLLM's Python
# literals: numbers, strings, booleans, None, lists and dicts of them): compared, stored as
# JSON, never computed with, so a value is narrowed where one is read.
Levers = dict[str, object]
# Session.state(): every field of a `Session`, as checkpoints keep it (JSON)
SessionState = dict[str, object]


class SessionRow(TypedDict):
    """A session's `runs` row (`Store.upsert_run`'s fields)."""

    started_at: datetime | None
    ended_at: datetime | None
    label: str
    target: str | None
    model: str | None
    vllm_version: str | None
    levers: Levers
    status: str
    notes: RunNotes


def label_value(text: str) -> bool | int | float | str | None:
    """A Prometheus label value in the spelling of `non-default args`: "True" → true,
    "128" → 128, "None" → null; anything else stays a string."""
    if text in ("True", "False"):
        return text == "True"
    if text == "None":
        return None
    if _NUMBER.match(text):
        number = float(text)
        return int(number) if number.is_integer() and "." not in text else number
    return text


def cache_levers(labels: dict[str, str]) -> Levers:
    """The levers `vllm:cache_config_info` shows (flag names, JSON values, unset ones left out)."""
    out: Levers = {}
    for label, flag in CACHE_LEVERS.items():
        if label in labels and (value := label_value(labels[label])) is not None:
            out[flag] = value
    return out


def _stamp(ts: datetime) -> str:
    return ts.astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")


def instance_name(text: str) -> str:
    """A host or instance name as it goes into run ids: letters, digits, `.`, `_` and `-`, any
    other run of characters one `-` ("" when nothing is left)."""
    return _UNSAFE.sub("-", text).strip("-")


def default_instance() -> str:
    """This collector's instance when none is given: `$SERVESCOPE_INSTANCE`, else the host name."""
    return instance_name(settings.instance()) or "host"


def session_run_id(model: str, port: int, started: datetime, instance: str | None = None) -> str:
    """`vllm-<model>-<instance>-<port>-<UTC start>`; without an instance the older spelling,
    `vllm-<model>-<port>-<UTC start>`."""
    name = instance_name(model) or "model"
    host = instance_name(instance) if instance else ""
    return f"vllm-{name}-{host + '-' if host else ''}{port}-{_stamp(started)}"


def same_instance(theirs: str | None, mine: str | None) -> bool:
    """Whether a session of instance `theirs` may be the one a session of `mine` followed: the
    same instance, or one from before instances (None: a checkpoint an older collector wrote on
    this store for this log, taken for this host's)."""
    return theirs is None or theirs == mine


def served_model(args: Levers) -> str | None:
    """The name clients use: `--served-model-name` (its first), else the model path's name."""
    served = args.get("served_model_name")
    if isinstance(served, list) and served:
        served = served[0]
    if isinstance(served, str) and served:
        return served
    model = args.get("model") or args.get("model_tag")
    return PurePath(model).name if isinstance(model, str) and model else None


@dataclass
class Session:
    """One server lifetime as far as it has been read."""

    run_id: str | None = None  # None until the model and port are known
    instance: str | None = None  # the collector's host (`collect --instance`); None: before them
    started_at: str | None = None  # ISO, UTC
    last_ts: str | None = None
    ended_at: str | None = None
    version: str | None = None
    model: str | None = None
    model_path: str | None = None
    port: int | None = None
    target: str | None = None
    args: Levers = field(default_factory=dict)  # `non-default args`, secrets left out
    cache_config: dict[str, str] = field(default_factory=dict)
    kv_cache: KvStatement = field(default_factory=lambda: KvStatement())  # vLLM's, at start-up
    cold_start: dict[str, float] = field(default_factory=dict)  # its start-up phases (seconds, GiB)
    previous: str | None = None  # the run of the session this one followed, on the same log
    previous_levers: Levers | None = None
    previous_args: Levers | None = None  # its `non-default args`
    previous_scraped: bool = False  # whether `previous_levers` hold that server's cache config
    source: str | None = None
    engines: dict[str, EngineNotes] = field(default_factory=dict)  # DP rank → its KV statement
    gpus: dict[str, dict[str, float]] = field(default_factory=dict)  # `gpu_key` → its memory (GiB)

    @classmethod
    def from_state(cls, state: SessionState | None) -> Session | None:
        """The session a checkpoint kept (keys an older collector wrote and this one has no
        field for are left out)."""
        if not state:
            return None
        known: dict[str, Any] = {k: v for k, v in state.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def state(self) -> SessionState:
        return asdict(self)

    @property
    def named(self) -> bool:
        return self.run_id is not None

    @property
    def levers(self) -> Levers:
        """The configuration: every non-default arg, plus the cache levers only the server's
        `/metrics` shows (a default left implicit, e.g. prefix caching on)."""
        return {**cache_levers(self.cache_config), **self.args}

    @property
    def status(self) -> str:
        return "ended" if self.ended_at else "running"

    def started(self) -> datetime | None:
        return _parse(self.started_at)

    def ended(self) -> datetime | None:
        return _parse(self.ended_at)

    def seen(self, ts: datetime | None) -> None:
        if ts is not None:
            self.last_ts = iso(ts)

    def configure(
        self, args: Levers, ts: datetime | None, port: int | None, host: str | None
    ) -> None:
        """What `non-default args` says: the levers, the model, the port; names the run."""
        self.args = dict(args)
        self.model = served_model(args) or self.model
        model_path = args.get("model") or args.get("model_tag")
        self.model_path = model_path if isinstance(model_path, str) else self.model_path
        self.port = port or DEFAULT_PORT
        if not self.target:
            shown = host if isinstance(host, str) and host not in ("", "0.0.0.0", "::") else None
            self.target = f"http://{shown or '127.0.0.1'}:{self.port}"
        if self.started_at is None:
            self.started_at = iso(ts or utcnow())
        start = self.started()
        assert start is not None
        self.run_id = session_run_id(self.model or "model", self.port, start, self.instance)

    def listening(self, url: str) -> None:
        parsed = urlparse(url)
        host = parsed.hostname if parsed.hostname not in (None, "0.0.0.0", "::") else "127.0.0.1"
        port = parsed.port or self.port or DEFAULT_PORT
        self.target = f"{parsed.scheme or 'http'}://{host}:{port}"

    def cache(self, labels: dict[str, str]) -> bool:
        """The server's `vllm:cache_config_info`; True when it changed the levers."""
        before = self.levers
        self.cache_config = dict(labels)
        return self.levers != before

    def flips(self) -> list[tuple[str, object, object]]:
        """(lever, before, after) for each lever that differs from the previous session's.

        A cache lever only `/metrics` shows (block size, KV dtype…) is known on both sides only
        once both servers were scraped; until then (a restart read before the new process is
        scraped, a collector started after the old server died) each side counts the flags
        its `non-default args` set, so "unknown" is never recorded as a flip to or from unset."""
        if self.previous_levers is None:
            return []
        before, after = self.previous_levers, self.levers
        if not (self.previous_scraped and self.cache_config):
            before = _as_flags(before, self.previous_args)
            after = _as_flags(after, self.args)
        return [
            (lever, before.get(lever), after.get(lever))
            for lever in sorted(set(before) | set(after))
            if before.get(lever) != after.get(lever)
        ]

    def statement(self, values: KvStatement, engine: str | None) -> None:
        """vLLM's KV statement: the server's (`kv_cache`: its only engine's, or the first
        engine's), and each data-parallel engine's own (`engines`), every engine sizing its
        own cache."""
        if engine is None or engine == "0":
            self.kv_cache = {**self.kv_cache, **values}
        if engine is not None:
            mine = self.engines.setdefault(engine, {})
            mine["kv_cache"] = {**mine.get("kv_cache", {}), **values}

    def phase(
        self,
        values: dict[str, float],
        ts: datetime | None,
        *,
        ready: bool,
        engine: str | None = None,
        rank: str | None = None,
    ) -> None:
        """A start-up phase line (`wire.vllm_log.PHASES`); `ready` (uvicorn's `Application
        startup complete`) gives `ready_s`, from the session's first line, timed by `ts` or,
        for an undated text line, the last dated line before it. Every process of a parallel
        server (each engine, each tensor-parallel worker) logs its own phases: its memory
        figures go to `gpus`, one entry per GPU, and the session's `cold_start` is the first
        process's, so a compile time every worker logs is not summed over them."""
        memory = {k: v for k, v in values.items() if k.endswith("_gib")}
        if memory:
            key = vllm_log.gpu_key(engine, rank)
            self.gpus[key] = {**self.gpus.get(key, {}), **memory}
        if engine in (None, "0") and rank in (None, "0"):
            self.cold_start = vllm_log.add_phase(self.cold_start, values)
        self.seen(ts)
        start, at = self.started(), _parse(self.last_ts)
        if ready and "ready_s" not in self.cold_start and start is not None and at is not None:
            self.cold_start["ready_s"] = round((at - start).total_seconds(), 3)

    def end(self, ts: datetime | None) -> None:
        self.ended_at = iso(ts) if ts else (self.last_ts or self.started_at)

    def run_row(self) -> SessionRow:
        """The session's `runs` row."""
        notes: RunNotes = {"kind": "vllm-session", "previous": self.previous}
        if self.source is not None:
            notes["log"] = self.source
        if self.instance:
            notes["instance"] = self.instance
        if self.model_path:
            notes["model_path"] = self.model_path
        if self.cache_config:
            notes["cache_config"] = self.cache_config
        if self.kv_cache:
            notes["kv_cache"] = {"vllm": self.kv_cache, "servescope": None}
        if self.engines:
            notes["engines"] = self.engines
        if self.cold_start:
            notes["cold_start"] = self.cold_start
        notes["parallel"] = self.parallel()
        if self.gpus:
            notes["gpus"] = self.gpus
        return {
            "started_at": _naive(self.started()),
            "ended_at": _naive(self.ended()),
            "label": LABEL,
            "target": self.target,
            "model": self.model,
            "vllm_version": self.version,
            "levers": self.levers,
            "status": self.status,
            "notes": notes,
        }

    def parallel(self) -> ParallelNotes:
        """How the server spreads over GPUs, from its flags: GPUs per engine (tensor and
        pipeline parallel), engines (data parallel), and whether a mixture-of-experts model's
        experts are spread over them (expert parallel)."""
        tp, pp, dp = (_size(self.args.get(f"{kind}_parallel_size"))
                      for kind in ("tensor", "pipeline", "data"))  # fmt: skip
        found: ParallelNotes = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp,
                                "data_parallel_size": dp, "gpus": tp * pp * dp}  # fmt: skip
        if self.args.get("enable_expert_parallel") is True:
            found["expert_parallel"] = True
        return found

    def served(self, doc: EventDoc) -> EventDoc:
        """Mark a request as one this session served: its `vllm_session`, and its model when
        the record names none (the client's stays)."""
        doc["vllm_session"] = self.run_id
        if self.model and "model" not in doc:
            doc["model"] = self.model
        return doc

    def covers(self, ts: datetime) -> bool:
        start, end = self.started(), self.ended()
        return start is not None and start <= ts and (end is None or ts <= end)


def _size(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def _as_flags(levers: Levers, args: Levers | None) -> Levers:
    """The levers without the cache levers only a scrape gave (`args` None: not known, all kept)."""
    if args is None:
        return levers
    return {k: v for k, v in levers.items() if k not in CACHE_FLAGS or k in args}


def _parse(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text) if text else None


def _naive(ts: datetime | None) -> datetime | None:
    return naive_utc(ts) if ts else None
