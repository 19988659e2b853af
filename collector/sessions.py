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
it was read up to, so a collector killed and restarted resumes the same session.

`Attribution` decides which session each thing the collector reads belongs to: a log's lines
(`ServerLog`, one per tailed log), trace pieces (`place_pieces`) and scrapes (`hold`, then
`place_scrapes`). The collector reads, joins and commits; it asks this module where things go.
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import PurePath
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from servescope.collector.scrape import Scrape
from servescope.store import settings
from servescope.wire import vllm_log
from servescope.wire.exposition import Sample
from servescope.wire.ids import UNATTRIBUTED_RUN, is_generated

if TYPE_CHECKING:
    import duckdb

    from servescope.store import Store

DEFAULT_PORT = settings.VLLM_PORT
LABEL = "vLLM server session"
KIND = "vllm-session"
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
REMEMBERED_IDS = 200_000  # vLLM-made request ids → their session, for traces that follow the log
# A server announces itself in its log some seconds after its process started (imports).
START_SLACK = timedelta(seconds=5)
START_WINDOW = timedelta(minutes=15)
HELD_SCRAPE_S = 600.0  # a scrape waits this long for its server's session to appear in the log
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_NUMBER = re.compile(r"^-?\d+(\.\d+)?([eE][-+]?\d+)?$")


def label_value(text: str) -> Any:
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


def cache_levers(labels: dict[str, str]) -> dict[str, Any]:
    """The levers `vllm:cache_config_info` shows (flag names, JSON values, unset ones left out)."""
    out = {}
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


def served_model(args: dict[str, Any]) -> str | None:
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
    args: dict[str, Any] = field(default_factory=dict)  # `non-default args`, secrets left out
    cache_config: dict[str, str] = field(default_factory=dict)
    kv_cache: dict[str, Any] = field(default_factory=dict)  # vLLM's start-up KV statement
    cold_start: dict[str, float] = field(default_factory=dict)  # its start-up phases (seconds, GiB)
    previous: str | None = None  # the run of the session this one followed, on the same log
    previous_levers: dict[str, Any] | None = None
    previous_args: dict[str, Any] | None = None  # its `non-default args`
    previous_scraped: bool = False  # whether `previous_levers` hold that server's cache config
    source: str | None = None
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)  # DP rank → its KV statement
    gpus: dict[str, dict[str, float]] = field(default_factory=dict)  # `gpu_key` → its memory (GiB)

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> Session | None:
        if not state:
            return None
        known = {k: v for k, v in state.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def state(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def named(self) -> bool:
        return self.run_id is not None

    @property
    def levers(self) -> dict[str, Any]:
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
            self.last_ts = _iso(ts)

    def configure(
        self, args: dict[str, Any], ts: datetime | None, port: int | None, host: str | None
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
            self.started_at = _iso(ts or datetime.now(UTC))
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

    def flips(self) -> list[tuple[str, Any, Any]]:
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

    def statement(self, values: dict[str, Any], engine: str | None) -> None:
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
        self.ended_at = _iso(ts) if ts else (self.last_ts or self.started_at)

    def run_row(self) -> dict[str, Any]:
        """The session's `runs` row."""
        notes: dict[str, Any] = {"kind": KIND, "log": self.source, "previous": self.previous}
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

    def parallel(self) -> dict[str, int]:
        """How the server spreads over GPUs, from its flags: GPUs per engine (tensor and
        pipeline parallel) and engines (data parallel)."""
        tp, pp, dp = (_size(self.args.get(f"{kind}_parallel_size"))
                      for kind in ("tensor", "pipeline", "data"))  # fmt: skip
        return {"tensor_parallel_size": tp, "pipeline_parallel_size": pp,
                "data_parallel_size": dp, "gpus": tp * pp * dp}  # fmt: skip

    def served(self, doc: dict[str, Any]) -> dict[str, Any]:
        """Mark a request as one this session served: its `vllm_session`, and its model when
        the record names none (the client's stays)."""
        doc["vllm_session"] = self.run_id
        if self.model and "model" not in doc:
            doc["model"] = self.model
        return doc

    def covers(self, ts: datetime) -> bool:
        start, end = self.started(), self.ended()
        return start is not None and start <= ts and (end is None or ts <= end)


class ServerLog:
    """The sessions of one vLLM log as far as it was read: the one it is in now (`session`), and
    what the one before left (`state["previous"]`: the levers a restart is compared with).
    `state` is the log's checkpoint state."""

    def __init__(self, name: str, state: dict[str, Any], attribution: Attribution) -> None:
        self.name = name
        self.state = state
        self.session = Session.from_state(state.get("session"))
        self._attribution = attribution

    @property
    def run_id(self) -> str | None:
        """The run of the session the log is in now (None until it is named)."""
        return self.session.run_id if self.session is not None else None

    def snapshot(self) -> dict[str, Any] | None:
        return self.session.state() if self.session is not None else None

    def changed_state(self, before: dict[str, Any] | None) -> dict[str, Any] | None:
        """The log's state to checkpoint when its session changed since `snapshot()` gave
        `before`; None when it did not."""
        after = self.snapshot()
        if after == before:
            return None
        self.state["session"] = after
        return self.state

    def seen(self, ts: datetime | None) -> None:
        """A dated line of the server: its session was alive then."""
        if self.session is not None:
            self.session.seen(ts)

    def attribute(self, doc: dict[str, Any]) -> dict[str, Any]:
        """A piece read from the server's log: the request's session, its model, and its run
        when vLLM made up its id (no client `X-Request-Id`)."""
        session = self.session
        if session is None or not session.named:
            if is_generated(doc["request_id"]) and "run_id" not in doc:
                doc["run_id"] = UNATTRIBUTED_RUN
            return doc
        assert session.run_id is not None
        session.served(doc)
        if is_generated(doc["request_id"]):
            doc["run_id"] = session.run_id
            self._attribution.remember(doc["request_id"], session.run_id)
        return doc

    def startup(self, item: vllm_log.Startup) -> None:
        """A start-up line: a version banner starts a session, `Starting vLLM server on URL`
        gives its target, a shutdown ends it."""
        session = self.session
        if item.version is not None:
            self._end(item.ts)
            self.session = Session(
                version=item.version, source=self.name, instance=self._attribution.instance
            )
            self.session.seen(item.ts)
            self.session.started_at = self.session.last_ts
        elif session is None:
            return
        elif item.url is not None:
            session.listening(item.url)
            self._attribution.touch(session)
        elif item.shutdown and session.ended_at is None:
            session.end(item.ts)
            self._attribution.touch(session)

    def configure(self, item: vllm_log.Levers) -> None:
        """`non-default args`: the session's levers and name. A second such line in one
        session (a log without version banners) is a new session."""
        if self.session is None or self.session.args or self.session.named:
            self._end(item.ts)
            self.session = Session(source=self.name, instance=self._attribution.instance)
        session = self.session
        previous = self.state.get("previous")
        # another instance's session on this store's checkpoint of a log of the same name (a
        # store two hosts took turns with) is not the one this server followed
        if previous and same_instance(previous.get("instance"), session.instance):
            session.previous, session.previous_levers = previous["run_id"], previous["levers"]
            session.previous_args = previous.get("args")
            session.previous_scraped = bool(previous.get("scraped"))
        session.configure(item.levers, item.ts, item.port, item.host)
        if previous and session.run_id == previous["run_id"]:  # two starts in one second
            session.run_id = f"{session.run_id}-2"
        self._attribution.touch(session)

    def kv_cache(self, item: vllm_log.KvCache) -> None:
        """vLLM's start-up KV-cache statement, into the session's runs row
        (`notes.kv_cache.vllm`)."""
        session = self.session
        if session is not None:
            session.seen(item.ts)
            session.statement(item.values, item.engine)
            self._attribution.touch(session)

    def phase(self, item: vllm_log.Phase) -> None:
        """A start-up phase (model loading, compilation, CUDA graphs, engine init, ready) into
        the session's runs row (`notes.cold_start`)."""
        if self.session is not None:
            self.session.phase(item.values, item.ts, ready=item.ready, engine=item.engine,
                               rank=item.rank)  # fmt: skip
            self._attribution.touch(self.session)

    def _end(self, ts: datetime | None) -> None:
        """The current session is over (a new one starts): it is kept as the one the next
        session's levers are compared with."""
        session = self.session
        if session is None:
            return
        if session.named:
            if session.ended_at is None:
                session.end(None)  # its last line: the new start may come much later
            self._attribution.ended(session)
            self.state["previous"] = {
                "run_id": session.run_id,
                "levers": session.levers,
                "args": session.args,
                "scraped": bool(session.cache_config),
                "instance": session.instance,
            }
        self.session = None


class Attribution:
    """Every server session one collector knows of, and which of them each request piece and
    each scrape belongs to. Sessions that changed wait in `changed()` for the next flush, which
    writes their `runs` rows and flips. Not thread-safe: the collector calls it under its lock,
    or from its flushing thread."""

    def __init__(self, instance: str | None = None) -> None:
        self.instance = instance  # the collector's host, in the ids of the sessions it names
        self.logs: list[ServerLog] = []
        self.targets: dict[str, dict[str, Any]] = {}  # metrics URL → its checkpoint state
        self._held: list[tuple[float, Scrape]] = []  # scrapes waiting for their server's session
        self._ended: dict[str, Session] = {}  # sessions that ended while this process ran
        self._run_of: OrderedDict[str, str] = OrderedDict()  # vLLM-made request id → its run
        self._changed: dict[str, Session] = {}

    def follow_log(self, name: str, state: dict[str, Any]) -> ServerLog:
        """A tailed vLLM log, resumed from its checkpoint state."""
        log = ServerLog(name, state, self)
        self.logs.append(log)
        return log

    def follow_target(self, url: str, state: dict[str, Any]) -> None:
        """A scraped `/metrics` URL, resumed from its checkpoint state."""
        self.targets[url] = state

    # -- sessions ------------------------------------------------------------------------------

    def touch(self, session: Session) -> None:
        """The session's `runs` row (and its flips) go with the next flush."""
        if session.run_id:
            self._changed[session.run_id] = replace(session)  # as it is now

    def ended(self, session: Session) -> None:
        self.touch(session)
        self._ended[session.run_id or ""] = session

    def changed(self) -> dict[str, Session]:
        """The sessions touched since the last call, by run (each as it was last touched)."""
        changed, self._changed = self._changed, {}
        return changed

    def sessions(self) -> list[Session]:
        """Every session this collector knows of: the current one of each log and each
        metrics-only target, and those that ended while it ran."""
        found = {s.run_id: s for s in self._ended.values()}
        for log in self.logs:
            if log.session is not None and log.session.named:
                found[log.session.run_id] = log.session
        for state in self.targets.values():
            own = Session.from_state(state.get("session"))
            if own is not None and own.named:
                found[own.run_id] = own
        return list(found.values())

    def remember(self, request_id: str, run_id: str) -> None:
        self._run_of[request_id] = run_id
        self._run_of.move_to_end(request_id)
        while len(self._run_of) > REMEMBERED_IDS:
            self._run_of.popitem(last=False)

    # -- trace pieces --------------------------------------------------------------------------

    def place_pieces(
        self, docs: list[dict[str, Any]], store: Store, con: duckdb.DuckDBPyConnection
    ) -> None:
        """Give trace pieces of requests vLLM made the id of their session's run, and take in
        requests stored before their session was known (prepended to `docs`).

        A trace carries no session: its request is found where the log put it (remembered ids,
        else the store), else in the one session whose lifetime holds its start. A request kept
        under `vllm-unattributed` moves to its session when a log line names it.
        """
        unknown = [
            d["request_id"]
            for d in docs
            if "run_id" not in d and is_generated(d["request_id"])
            and d["request_id"] not in self._run_of
        ]  # fmt: skip
        found = store.runs_of_requests(unknown, con) if unknown else {}
        sessions = None
        for doc in docs:
            rid = doc["request_id"]
            if "run_id" in doc or not is_generated(rid):
                if "vllm_session" not in doc and doc.get("source") == "vllm-trace":
                    sessions = sessions if sessions is not None else self.sessions()
                    _in_session(doc, sessions)
                continue
            run = self._run_of.get(rid) or found.get(rid)
            if run is None:
                sessions = sessions if sessions is not None else self.sessions()
                session = _in_session(doc, sessions)
                run = session.run_id if session is not None else UNATTRIBUTED_RUN
            doc["run_id"] = run
        placed = {
            d["request_id"]: d["run_id"] for d in docs
            if d.get("run_id") not in (None, UNATTRIBUTED_RUN) and is_generated(d["request_id"])
        }  # fmt: skip
        if placed:
            earlier = store.take_events(UNATTRIBUTED_RUN, list(placed), con)
            for doc in earlier:
                doc["run_id"] = placed[doc["request_id"]]
            docs[:0] = earlier

    # -- scrapes -------------------------------------------------------------------------------

    def restarted(self, result: Scrape) -> bool:
        """Whether the scrape saw a new server process behind its URL (its version is wanted)."""
        start = self.targets[result.url].get("start")
        return result.process_start is not None and result.process_start != start

    def hold(self, result: Scrape, version: str | None) -> None:
        """A scrape, held until `place_scrapes` finds its session; `version`: the server's,
        when `restarted` asked for it."""
        if version is not None:
            self.targets[result.url]["version"] = version
        self._held.append((time.monotonic(), result))

    def holding(self) -> bool:
        return bool(self._held)

    def place_scrapes(self) -> list[tuple[str, list[Sample], dict[str, Any]]]:
        """Give held scrapes their server session's run: (url, its samples under that run, the
        target's state to checkpoint) for each scrape placed; the others stay held.

        A target is a server whose log this collector tails when their ports agree: its session
        is the one that started with the process the scrape saw (`process_start_time_seconds`),
        so samples taken just after a restart wait until the log has shown the new start. A
        target without a log is its own session, one per process start.
        """
        keep: list[tuple[float, Scrape]] = []
        placed: list[tuple[str, list[Sample], dict[str, Any]]] = []
        for held_since, result in self._held:
            state = self.targets[result.url]
            waited = time.monotonic() - held_since >= HELD_SCRAPE_S
            session: Session | None = None
            if result.process_start is None:  # down, or not a vLLM: the target's last session
                session = self._target_session(result.url)
            elif self.logs:
                port = urlparse(result.url).port
                session = self._logged_session(port, result.process_start)
                if session is None and waited:
                    session = self._own_session(result)
            else:
                session = self._own_session(result)
            if session is None and result.process_start is not None and not waited:
                keep.append((held_since, result))
                continue
            run = session.run_id if session is not None else None
            if session is not None:
                state["run_id"], state["start"] = run, result.process_start
                if result.cache_config is not None and session.cache(result.cache_config):
                    self.touch(session)
                if (state.get("session") or {}).get("run_id") == run:
                    state["session"] = session.state()
            samples = [
                (ts, target, name, labels, run, value)
                for ts, target, name, labels, _run, value in result.samples
            ]
            placed.append((result.url, samples, state))
        self._held = keep
        return placed

    def _logged_session(self, port: int | None, process_start: float) -> Session | None:
        started = datetime.fromtimestamp(process_start, UTC)
        found = [
            s
            for s in self.sessions()
            if s.source is not None
            and s.port == port
            and (start := s.started()) is not None
            and started - START_SLACK <= start <= started + START_WINDOW
        ]
        return min(found, key=lambda s: s.started_at or "") if found else None

    def _target_session(self, url: str) -> Session | None:
        run = self.targets[url].get("run_id")
        return next((s for s in self.sessions() if s.run_id == run), None)

    def _own_session(self, result: Scrape) -> Session:
        """The session of a target no tailed log describes, named from its process start."""
        state = self.targets[result.url]
        current = Session.from_state(state.get("session"))
        assert result.process_start is not None
        started = datetime.fromtimestamp(result.process_start, UTC)
        if current is not None and current.started() == started:
            return current
        model = next(
            (labels["model_name"] for _t, _u, _n, labels, _r, _v in result.samples
             if labels.get("model_name")),
            None,
        )  # fmt: skip
        parsed = urlparse(result.url)
        port = parsed.port or 80
        session = Session(
            run_id=session_run_id(model or "model", port, started, self.instance),
            instance=self.instance,
            started_at=started.isoformat(),
            version=state.get("version"),
            model=model,
            port=port,
            target=f"{parsed.scheme}://{parsed.netloc}",
        )
        if current is not None:
            current.end(started)
            self.ended(current)
        if current is not None and same_instance(current.instance, self.instance):
            session.previous, session.previous_levers = current.run_id, current.levers
            session.previous_args = current.args
            session.previous_scraped = bool(current.cache_config)
        state["session"] = session.state()
        self.touch(session)
        return session


def _size(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def _in_session(doc: dict[str, Any], sessions: list[Session]) -> Session | None:
    """The only session whose lifetime holds the request's server start (trace pieces)."""
    ts = parse_ts(doc.get("server_ts"))
    if ts is None:
        return None
    holding = [s for s in sessions if s.covers(ts)]
    if len(holding) != 1:
        return None
    holding[0].served(doc)
    return holding[0]


def parse_ts(text: Any) -> datetime | None:
    """An ISO time of a record (naive ones are UTC); None when it is not one."""
    if not isinstance(text, str):
        return None
    try:
        ts = datetime.fromisoformat(text)
    except ValueError:
        return None
    return ts if ts.tzinfo else ts.replace(tzinfo=UTC)


def _as_flags(levers: dict[str, Any], args: dict[str, Any] | None) -> dict[str, Any]:
    """The levers without the cache levers only a scrape gave (`args` None: not known, all kept)."""
    if args is None:
        return levers
    return {k: v for k, v in levers.items() if k not in CACHE_FLAGS or k in args}


def _iso(ts: datetime) -> str:
    if ts.tzinfo is None:
        ts = ts.replace(tzinfo=UTC)
    return ts.astimezone(UTC).isoformat()


def _parse(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text) if text else None


def _naive(ts: datetime | None) -> datetime | None:
    return ts.astimezone(UTC).replace(tzinfo=None) if ts else None
