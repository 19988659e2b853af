"""Which server session each thing the collector reads belongs to.

A log's lines go to the session the log is in now (`ServerLog`, one per tailed log); trace pieces
to where the log put their id, else to the one session whose lifetime holds their start
(`Attribution.place_pieces`); scrapes wait (`hold`) until the session of the process they saw is
known (`place_scrapes`). The collector reads, joins and commits; it asks this module where things
go, and collector/sessions.py what a session is.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, NotRequired, TypedDict, cast
from urllib.parse import urlparse

from servescope.collector.scrape import Scrape
from servescope.collector.sessions import (
    Levers,
    Session,
    SessionState,
    same_instance,
    session_run_id,
)
from servescope.store.validation import EventDoc
from servescope.wire import vllm_log
from servescope.wire.exposition import Sample
from servescope.wire.ids import UNATTRIBUTED_RUN, is_generated

if TYPE_CHECKING:
    import duckdb

    from servescope.store import Store

REMEMBERED_IDS = 200_000  # vLLM-made request ids → their session, for traces that follow the log
# A server announces itself in its log some seconds after its process started (imports).
START_SLACK = timedelta(seconds=5)
START_WINDOW = timedelta(minutes=15)
HELD_SCRAPE_S = 600.0  # a scrape waits this long for its server's session to appear in the log


class PreviousSession(TypedDict):
    """What the session a log was in before left for the next one: the levers a restart is
    compared with (a checkpoint of an older collector lacks the keys not required)."""

    run_id: str | None
    levers: Levers
    args: NotRequired[Levers | None]
    scraped: NotRequired[bool]
    instance: NotRequired[str | None]


class LogState(TypedDict, total=False):
    """A tailed log's checkpoint state: the session it is in, and the one before."""

    session: SessionState | None
    previous: PreviousSession


class TargetState(TypedDict, total=False):
    """A scraped `/metrics` URL's checkpoint state: the run its samples go to, the process
    start they were of, the server's version, and its own session (a target no log tells of)."""

    run_id: str | None
    start: float | None
    version: str
    session: SessionState


class ServerLog:
    """The sessions of one vLLM log as far as it was read: the one it is in now (`session`), and
    what the one before left (`state["previous"]`: the levers a restart is compared with).
    `state` is the log's checkpoint state."""

    def __init__(self, name: str, state: LogState, attribution: Attribution) -> None:
        self.name = name
        self.state = state
        self.session = Session.from_state(state.get("session"))
        self._attribution = attribution

    @property
    def run_id(self) -> str | None:
        """The run of the session the log is in now (None until it is named)."""
        return self.session.run_id if self.session is not None else None

    def snapshot(self) -> SessionState | None:
        return self.session.state() if self.session is not None else None

    def changed_state(self, before: SessionState | None) -> LogState | None:
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

    def attribute(self, doc: EventDoc) -> EventDoc:
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
            self._end()
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
            self._end()
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

    def _end(self) -> None:
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
        self.targets: dict[str, TargetState] = {}  # metrics URL → its checkpoint state
        self._held: list[tuple[float, Scrape]] = []  # scrapes waiting for their server's session
        self._ended: dict[str, Session] = {}  # sessions that ended while this process ran
        self._run_of: OrderedDict[str, str] = OrderedDict()  # vLLM-made request id → its run
        self._changed: dict[str, Session] = {}

    def follow_log(self, name: str, state: Mapping[str, object]) -> ServerLog:
        """A tailed vLLM log, resumed from its checkpoint state (what `ServerLog` wrote)."""
        log = ServerLog(name, cast(LogState, state), self)
        self.logs.append(log)
        return log

    def follow_target(self, url: str, state: Mapping[str, object]) -> None:
        """A scraped `/metrics` URL, resumed from its checkpoint state (what `place_scrapes`
        wrote)."""
        self.targets[url] = cast(TargetState, state)

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
        self, docs: list[EventDoc], store: Store, con: duckdb.DuckDBPyConnection
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
            # records the store kept met its rules when they came in
            taken = store.take_events(UNATTRIBUTED_RUN, list(placed), con)
            earlier = cast(list[EventDoc], taken)
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

    def place_scrapes(self) -> list[tuple[str, list[Sample], TargetState]]:
        """Give held scrapes their server session's run: (url, its samples under that run, the
        target's state to checkpoint) for each scrape placed; the others stay held.

        A target is a server whose log this collector tails when their ports agree: its session
        is the one that started with the process the scrape saw (`process_start_time_seconds`),
        so samples taken just after a restart wait until the log has shown the new start. A
        target without a log is its own session, one per process start.
        """
        keep: list[tuple[float, Scrape]] = []
        placed: list[tuple[str, list[Sample], TargetState]] = []
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


def _in_session(doc: EventDoc, sessions: list[Session]) -> Session | None:
    """The only session whose lifetime holds the request's server start (trace pieces)."""
    beside: Mapping[str, object] = doc  # a trace piece's start, a key beside the contract's
    ts = parse_ts(beside.get("server_ts"))
    if ts is None:
        return None
    holding = [s for s in sessions if s.covers(ts)]
    if len(holding) != 1:
        return None
    holding[0].served(doc)
    return holding[0]


def parse_ts(text: object) -> datetime | None:
    """An ISO time of a record (naive ones are UTC); None when it is not one."""
    if not isinstance(text, str):
        return None
    try:
        ts = datetime.fromisoformat(text)
    except ValueError:
        return None
    return ts if ts.tzinfo else ts.replace(tzinfo=UTC)
