"""The rules a line or a record must meet to enter the store, for every way in.

Every entry point uses this module: `servescope store import` and the collector's
line-by-line path (`parse_line`), the collector's bulk path (`store.bulk`, whose SQL and
pre-screen are derived from the constants here and are never more lenient), and pieces built
from vLLM's logs and traces (`check_built`). Validation never raises anything but
`InvalidEvent`, whose message is the quarantine reason a person reads in `ingest_errors`.

A line is good when:
- it is at most `MAX_LINE_BYTES` long and valid UTF-8 (a byte-order mark at its start and a
  CR before its newline are allowed);
- it is one strict JSON value (RFC 8259: no NaN/Infinity, no trailing commas, nothing after
  it) nested at most `MAX_DEPTH` deep; a number too large for a double is valid JSON and kept
  where the contract does not type it;
- it is an object; when a key repeats, the first value counts (what DuckDB reads too);
- it is a request record (`RequestEvent`: a non-empty string `request_id`, contract keys of
  their contract types: durations and rates finite and >= 0, token counts and concurrency
  integers in 0..2**31-1, `http_status` an integer in 100..999, `itl_ms` a list of such
  durations) or an agent-runtime event (`RuntimeLine`: a `type` other than "request", with a
  run or request id).

The two types are the contract's one definition: msgspec checks a record against them (its error
names the key, and the reason says what the key's value breaks), and `store.bulk` derives its SQL
from the same fields (`CONTRACT_TYPES`, `DURATIONS`, `COUNTS`). What passes leaves typed, as
`EventDoc` or `RuntimeDoc`: the line's own object (every key, in its order, for the byte-exact
export), its contract keys typed as the Structs type them.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import sys
from collections.abc import Mapping
from typing import Annotated, Any, Literal, NotRequired, TypedDict, cast, get_args

import msgspec
import msgspec.inspect as mi
from typing_extensions import TypeIs

MAX_LINE_BYTES = 1024 * 1024  # longest line taken; the tailer hands longer ones over as such
MAX_DEPTH = 64  # deepest nesting of arrays and objects in a line
MAX_RAW = 64 * 1024  # bytes of a refused line kept in ingest_errors.raw (with its length)
MAX_COUNT = 2**31 - 1  # token counts and concurrency are INTEGER columns
HTTP_STATUS = (100, 999)
_NUMBER = (int, float)
Status = Literal["ok", "error", "timeout", "rejected"]
# A duration or a rate: finite (at most the largest double) and >= 0. A count: an INTEGER.
Duration = Annotated[float, msgspec.Meta(ge=0, le=sys.float_info.max)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
HttpStatus = Annotated[int, msgspec.Meta(ge=HTTP_STATUS[0], le=HTTP_STATUS[1])]


class RequestEvent(msgspec.Struct, frozen=True, kw_only=True):
    """A request record's contract keys and their types (docs/architecture.md, "The event"):
    what a line must meet to be stored. Any other key is kept verbatim and not read here, so
    the stored and exported record stays the line itself; null is the same as absent."""

    request_id: Annotated[str, msgspec.Meta(min_length=1)]
    run_id: str | None = None
    ts: str | None = None
    model: str | None = None
    team: str | None = None
    workload: str | None = None
    source: str | None = None
    prompt_tokens: Count | None = None
    completion_tokens: Count | None = None
    cached_tokens: Count | None = None
    concurrency: Count | None = None
    target_rate: Duration | None = None
    cache_hit: bool | None = None
    ttft_ms: Duration | None = None
    tpot_ms: Duration | None = None
    e2e_ms: Duration | None = None
    itl_ms: list[Duration] | None = None
    queue_ms: Duration | None = None
    prefill_ms: Duration | None = None
    # typed columns beyond the contract table: vLLM's own timings, the serving session
    server_ttft_ms: Duration | None = None
    server_e2e_ms: Duration | None = None
    server_tpot_ms: Duration | None = None
    vllm_session: str | None = None
    decode_ms: Duration | None = None
    finish_reason: str | None = None
    status: Status | None = None
    http_status: HttpStatus | None = None
    error: str | None = None
    trace_id: str | None = None


class _EventKey(TypedDict):
    request_id: str  # the one key a request record must have


class EventDoc(_EventKey, total=False):
    """A request record that met the rules (`check`), as it leaves validation and is merged
    and stored: its contract keys, of `RequestEvent`'s types (null as absent), and any other
    key kept verbatim. A TypedDict, not the Struct, so the record is the line's own object
    (key order, number types and unknown keys unchanged) for the byte-exact `.events.jsonl`
    round trip; tests/unit/test_store.py ties its keys to `RequestEvent` and to the columns."""

    run_id: str | None
    ts: str | None
    model: str | None
    team: str | None
    workload: str | None
    source: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    concurrency: int | None
    target_rate: float | None
    cache_hit: bool | None
    ttft_ms: float | None
    tpot_ms: float | None
    e2e_ms: float | None
    itl_ms: list[float] | None
    queue_ms: float | None
    prefill_ms: float | None
    server_ttft_ms: float | None
    server_e2e_ms: float | None
    server_tpot_ms: float | None
    vllm_session: str | None
    decode_ms: float | None
    finish_reason: str | None
    status: Status | None
    http_status: int | None
    error: str | None
    trace_id: str | None


class RuntimeDoc(TypedDict):
    """An agent-runtime line that met the rules (`RuntimeLine`), kept verbatim."""

    type: str
    run_id: NotRequired[str | None]
    request_id: NotRequired[str | None]
    ts: NotRequired[str | None]
    trace_id: NotRequired[str | None]


class RuntimeLine(msgspec.Struct, frozen=True, kw_only=True):
    """An agent-runtime line's keys the store reads (`type` other than "request"): it belongs
    to a run through `run_id` or `request_id`."""

    type: str
    run_id: str | None = None
    request_id: str | None = None
    ts: str | None = None
    trace_id: str | None = None


def _accepted(kind: mi.Type) -> tuple[type, ...]:
    """The Python types a decoded value of this msgspec type has (an integer is a float too)."""
    if isinstance(kind, mi.UnionType):
        return tuple(t for k in kind.types if not isinstance(k, mi.NoneType) for t in _accepted(k))
    found: dict[type[mi.Type], tuple[type, ...]] = {
        mi.StrType: (str,), mi.LiteralType: (str,), mi.IntType: (int,), mi.FloatType: _NUMBER,
        mi.BoolType: (bool,), mi.ListType: (list,),
    }  # fmt: skip
    return found[type(kind)]


def _bounded(kind: mi.Type) -> mi.Type:
    """The type a nullable field has when it is not null."""
    if isinstance(kind, mi.UnionType):
        return next(k for k in kind.types if not isinstance(k, mi.NoneType))
    return kind


def _fields(record: type[msgspec.Struct]) -> dict[str, mi.Type]:
    info = mi.type_info(record)
    assert isinstance(info, mi.StructType)
    return {f.name: _bounded(f.type) for f in info.fields}


Kinds = dict[str, tuple[type, ...]]
_FIELDS = _fields(RequestEvent)
# key -> accepted Python types after decoding (bool is an int subclass: excluded explicitly);
# what store.bulk's SQL conditions are derived from
CONTRACT_TYPES: Kinds = {k: _accepted(t) for k, t in _FIELDS.items()}
RUNTIME_TYPES: Kinds = {k: _accepted(t) for k, t in _fields(RuntimeLine).items()}
DURATIONS = tuple(k for k, t in _FIELDS.items() if isinstance(t, mi.FloatType))
COUNTS = tuple(k for k, t in _FIELDS.items() if isinstance(t, mi.IntType) and t.le == MAX_COUNT)
STATUSES = frozenset(get_args(Status))
REQUEST_TYPE = "request"  # the only `type` a request record may carry
_RUN_SUFFIX = re.compile(r"(.)-[0-9]+\Z")  # never the whole id: "-000001" is its own run
_BOM = b"\xef\xbb\xbf"
_DECODER = msgspec.json.Decoder()
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abAB]")
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NON_FINITE = re.compile(rb"[:,\[]\s*[-+]?(?i:nan|inf)")
_INF = f"\x00inf-{secrets.token_hex(8)}\x00"  # a float too large for JSON's grammar (dumps)
_STRICT = {ascii: json.JSONEncoder(allow_nan=False, ensure_ascii=ascii) for ascii in (True, False)}
_BUILT = json.JSONEncoder(allow_nan=False, ensure_ascii=False)


class InvalidEvent(ValueError):
    """A record that cannot be stored; the message is the quarantine reason."""


Record = EventDoc | RuntimeDoc  # a line of `.events.jsonl` that met the rules


def run_id_of(doc: Mapping[str, Any]) -> str:
    """The run of a record: its `run_id`, else its `request_id` less the `-<digits>` tail (the
    whole `request_id` when nothing precedes the tail)."""
    run_id = doc.get("run_id")
    if isinstance(run_id, str) and run_id:
        return run_id
    return _RUN_SUFFIX.sub(r"\1", doc["request_id"])


def is_runtime_event(doc: Mapping[str, Any]) -> TypeIs[RuntimeDoc]:
    """An agent-runtime line (tool call, approval, test result…), not a request record.

    The agent runtime writes `{"type": "tool_call", …}` lines into the same `.events.jsonl`
    family; a request record has no `type` (or `"type": "request"`).
    """
    kind = doc.get("type")
    return isinstance(kind, str) and bool(kind) and kind != REQUEST_TYPE


def check_runtime(doc: RuntimeDoc) -> RuntimeDoc:
    """Return a runtime event if it can be stored: it needs a run (`run_id` or `request_id`)."""
    try:
        line = msgspec.convert(doc, RuntimeLine)
    except msgspec.ValidationError as exc:
        raise InvalidEvent(_reason(doc, exc, RUNTIME_TYPES)) from None
    if not line.run_id and not line.request_id:
        raise InvalidEvent(f"runtime event {line.type!r} has neither run_id nor request_id")
    return doc


def check(doc: object) -> Record:
    """Return `doc` if it is a storable request record or runtime event, else raise
    `InvalidEvent`. The record is checked as a `RequestEvent`; `doc` itself, every key of it,
    is what is stored."""
    if not isinstance(doc, dict):
        raise InvalidEvent(f"not a JSON object but {_kind(doc)}: one object per line")
    if is_runtime_event(doc):
        return check_runtime(doc)
    return check_request(doc)


def check_request(doc: Mapping[str, Any]) -> EventDoc:
    """Return `doc` if it is a storable request record (a `RequestEvent`), else raise
    `InvalidEvent` naming the key and what its value breaks."""
    request_id = doc.get("request_id")
    if not isinstance(request_id, str) or not request_id:  # the first thing a reason names
        raise InvalidEvent(
            "missing request_id" if request_id is None else "request_id is not a non-empty string"
        )
    try:
        msgspec.convert(doc, RequestEvent)
    except msgspec.ValidationError as exc:
        raise InvalidEvent(_reason(doc, exc, CONTRACT_TYPES)) from None
    return cast(EventDoc, doc)  # it met RequestEvent, whose keys EventDoc types


_AT = re.compile(r"at `\$\.([^`\[]+)(\[\d+\])?`")


def _reason(doc: Mapping[str, Any], exc: msgspec.ValidationError, types: Kinds) -> str:
    """The quarantine reason of a record msgspec refused, in the contract's words: the key at
    the error's path, and what its value breaks (its type, or the rule of durations, counts,
    HTTP status codes or statuses)."""
    message = str(exc)
    at = _AT.search(message)
    if at is None:
        return f"not a record of the contract: {message}"
    key, index = at.group(1), at.group(2) or ""
    value = doc.get(key)
    if key == "itl_ms" and isinstance(value, list):
        if all(isinstance(x, _NUMBER) and not isinstance(x, bool) for x in value):
            return f"itl_ms holds a gap that is not a finite duration >= 0 (itl_ms{index})"
        return "wrong type for itl_ms: not a list of numbers"
    accepted = types.get(key, ())
    if not isinstance(value, accepted) or (isinstance(value, bool) and bool not in accepted):
        return f"wrong type for {key}: {type(value).__name__}"
    if key == "status":
        return f"unknown status: {_shown(value)}"
    if key in DURATIONS:
        return f"{key} is {_shown(value)}: a duration must be finite and >= 0"
    if key in COUNTS:
        return f"{key} is {_shown(value)}: a count must be in 0..{MAX_COUNT}"
    if key == "http_status":
        return f"http_status is {_shown(value)}: not an HTTP status code"
    return f"{key}: {message}"


def _shown(value: object) -> str:
    """A refused value as a reason quotes it: its repr, cut at 40 characters."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**40:
        return "a number of more than 40 digits"
    text = repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


def check_built(doc: Mapping[str, Any]) -> EventDoc:
    """`check` for a request record built by a parser (a log line, a trace span) rather than
    read from a line: also what reading a line guarantees — it serialises to strict JSON (no
    NaN or infinity anywhere, no half surrogate in a string) nested at most `MAX_DEPTH` deep."""
    checked = check_request(doc)
    try:
        text = _BUILT.encode(doc).encode("utf-8")
    except ValueError:
        raise InvalidEvent("a number is NaN or infinite") from None
    except UnicodeEncodeError:
        raise InvalidEvent("a string holds half a surrogate pair (not text)") from None
    except RecursionError:
        raise InvalidEvent(f"nested deeper than {MAX_DEPTH} levels") from None
    _check_depth(text)
    return checked


def decode(data: bytes | str, *, max_bytes: int = MAX_LINE_BYTES) -> Any:
    """One JSON value by the rules above (size, UTF-8, strict JSON, depth, first key wins);
    raise `InvalidEvent` with a reason otherwise."""
    text = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if text.startswith(_BOM):
        text = text[len(_BOM) :]
    if len(text) > max_bytes:
        raise InvalidEvent(f"line too long ({len(text)} bytes; the limit is {max_bytes})")
    if not text.isascii():
        try:
            text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidEvent(f"not UTF-8: byte 0x{text[exc.start]:02x} at {exc.start}") from None
    _check_depth(text)
    try:
        doc = _DECODER.decode(text)
    except msgspec.ValidationError:  # a number beyond a double (or a huge integer): valid JSON
        doc = _json(text)
    except msgspec.DecodeError as exc:
        raise InvalidEvent(_json_reason(text, exc)) from None
    except RecursionError:  # _check_depth bounds nesting; kept so nothing escapes as a crash
        raise InvalidEvent(f"nested deeper than {MAX_DEPTH} levels") from None
    if isinstance(doc, dict) and _key_tokens(text) != len(doc):
        doc = _json(text)  # nested objects, or a key repeated: read again, first value wins
    return doc


def parse_line(line: str | bytes) -> Record:
    """Parse one `.events.jsonl` line; raise `InvalidEvent` with a reason when it is not one."""
    return check(decode(line))


def load_event(text: str) -> EventDoc:
    """A stored request record read back (it met the rules when it was stored)."""
    doc: EventDoc = decode(text, max_bytes=1 << 62)
    return doc


def load_runtime(text: str) -> RuntimeDoc:
    """A stored runtime event read back (it met the rules when it was stored)."""
    doc: RuntimeDoc = decode(text, max_bytes=1 << 62)
    return doc


def dumps(doc: object, *, ensure_ascii: bool = True) -> str:
    """A record as JSON text (stored, or exported). A float too large for a double (a line's
    `1e999` outside the contract) is written `1e999` — JSON that reads back the same — never
    `Infinity`."""
    encoder = _STRICT[ensure_ascii]
    try:
        return encoder.encode(doc)
    except ValueError:
        text = encoder.encode(_mark_inf(doc))
        return text.replace(f'"-{_json_str(_INF)}"', "-1e999").replace(
            f'"{_json_str(_INF)}"', "1e999"
        )


def clip(raw: bytes) -> bytes:
    """A refused line as kept in `ingest_errors.raw`: whole up to MAX_RAW bytes, else its head
    and its length."""
    raw = raw.rstrip(b"\r\n")
    if len(raw) <= MAX_RAW:
        return raw
    return raw[:MAX_RAW] + f"… [{len(raw)} bytes, cut]".encode()


# -- helpers -----------------------------------------------------------------------------------


def _kind(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


def _check_depth(text: bytes) -> None:
    if text.count(b"[") + text.count(b"{") <= MAX_DEPTH:  # the common case, at C speed
        return
    depth = 0
    for char in _STRING.sub(b"", text):  # brackets inside strings do not nest
        if char in b"[{":
            depth += 1
            if depth > MAX_DEPTH:
                raise InvalidEvent(f"nested deeper than {MAX_DEPTH} levels")
        elif char in b"]}":
            depth -= 1


def _key_tokens(text: bytes) -> int:
    """An upper bound of the keys in `text`: every key's closing quote is followed by a colon
    or by whitespace. Equal to the decoded object's length only when no key repeats and no
    object nests in it (the common case, proven without a second parse)."""
    count = text.count
    return count(b'":') + count(b'" ') + count(b'"\t') + count(b'"\r') + count(b'"\n')


def _first_wins(pairs: list[tuple[str, object]]) -> dict[str, object]:
    doc = dict(pairs)
    if len(doc) != len(pairs):
        doc = {}
        for key, value in pairs:
            doc.setdefault(key, value)
    return doc


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _int(text: str) -> int | float:
    return int(text) if len(text) <= 4000 else float(text)  # Python refuses longer int texts


def _json(text: bytes) -> Any:
    """The standard library's reading (first value of a repeated key wins), for what msgspec
    reads otherwise; only reached for text msgspec found to be strict JSON."""
    try:
        return json.loads(
            text,
            object_pairs_hook=_first_wins,
            parse_constant=_reject_constant,
            parse_int=_int,
        )
    except (ValueError, RecursionError) as exc:
        raise InvalidEvent(f"invalid JSON: {exc}") from None


def _json_reason(text: bytes, exc: msgspec.DecodeError) -> str:
    message = str(exc).removeprefix("JSON is malformed: ")
    if _NON_FINITE.search(text):
        return "invalid JSON: NaN and Infinity are not JSON numbers"
    if _SURROGATE_ESCAPE.search(text):
        return "invalid JSON: a \\u escape encodes half a surrogate pair (not text)"
    if message == "Input data was truncated":
        return "invalid JSON: the line ends inside a value"
    return f"invalid JSON: {message}"


def _mark_inf(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return _INF if value > 0 else f"-{_INF}"
    if isinstance(value, dict):
        return {k: _mark_inf(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_mark_inf(v) for v in value]
    return value


def _json_str(value: str) -> str:
    return json.dumps(value)[1:-1]
