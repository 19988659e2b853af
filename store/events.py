"""Validation of `.events.jsonl` records, before anything touches the database.

A record is a flat JSON object. The keys of the contract (docs/architecture.md) must have their
contract types; every other key is kept verbatim. Validation never raises: it returns the reason
a record is refused, so the caller can quarantine the line and keep going.
"""

from __future__ import annotations

import json
import re
from typing import Any

_NUMBER = (int, float)
# key -> accepted Python types after json.loads (bool is an int subclass: excluded explicitly)
CONTRACT_TYPES: dict[str, tuple[type, ...]] = {
    "request_id": (str,),
    "run_id": (str,),
    "ts": (str,),
    "model": (str,),
    "team": (str,),
    "workload": (str,),
    "source": (str,),
    "prompt_tokens": (int,),
    "completion_tokens": (int,),
    "cached_tokens": (int,),
    "concurrency": (int,),
    "target_rate": _NUMBER,
    "cache_hit": (bool,),
    "ttft_ms": _NUMBER,
    "tpot_ms": _NUMBER,
    "e2e_ms": _NUMBER,
    "itl_ms": (list,),
    "queue_ms": _NUMBER,
    "prefill_ms": _NUMBER,
    "decode_ms": _NUMBER,
    "finish_reason": (str,),
    "status": (str,),
    "http_status": (int,),
    "error": (str,),
    "trace_id": (str,),
}
STATUSES = frozenset({"ok", "error", "timeout", "rejected"})
REQUEST_TYPE = "request"  # the only `type` a request record may carry
_RUN_SUFFIX = re.compile(r"-\d+$")


class InvalidEvent(ValueError):
    """A record that cannot be stored; the message is the quarantine reason."""


def run_id_of(doc: dict[str, Any]) -> str:
    """The run of a record: its `run_id`, else its `request_id` less the `-<digits>` tail."""
    run_id = doc.get("run_id")
    if isinstance(run_id, str) and run_id:
        return run_id
    return _RUN_SUFFIX.sub("", doc["request_id"])


def is_runtime_event(doc: dict[str, Any]) -> bool:
    """An agent-runtime line (tool call, approval, test result…), not a request record.

    The agent runtime writes `{"type": "tool_call", …}` lines into the same `.events.jsonl`
    family; a request record has no `type` (or `"type": "request"`).
    """
    kind = doc.get("type")
    return isinstance(kind, str) and bool(kind) and kind != REQUEST_TYPE


def check_runtime(doc: dict[str, Any]) -> dict[str, Any]:
    """Return a runtime event if it can be stored: it needs a run (`run_id` or `request_id`)."""
    for key in ("run_id", "request_id", "ts", "trace_id"):
        if doc.get(key) is not None and not isinstance(doc[key], str):
            raise InvalidEvent(f"wrong type for {key}: {type(doc[key]).__name__}")
    if not doc.get("run_id") and not doc.get("request_id"):
        raise InvalidEvent(f"runtime event {doc['type']!r} has neither run_id nor request_id")
    return doc


def check(doc: Any) -> dict[str, Any]:
    """Return `doc` if it is a storable request record or runtime event, else raise
    `InvalidEvent`."""
    if not isinstance(doc, dict):
        raise InvalidEvent(f"not a JSON object: {type(doc).__name__}")
    if is_runtime_event(doc):
        return check_runtime(doc)
    if not isinstance(doc.get("request_id"), str) or not doc["request_id"]:
        raise InvalidEvent("missing request_id")
    for key, types in CONTRACT_TYPES.items():
        value = doc.get(key)
        if value is None:
            continue
        if isinstance(value, bool) and bool not in types:
            raise InvalidEvent(f"wrong type for {key}: bool")
        if not isinstance(value, types):
            raise InvalidEvent(f"wrong type for {key}: {type(value).__name__}")
    itl = doc.get("itl_ms")
    if itl is not None and not all(isinstance(x, _NUMBER) and not isinstance(x, bool) for x in itl):
        raise InvalidEvent("wrong type for itl_ms: not a list of numbers")
    status = doc.get("status")
    if status is not None and status not in STATUSES:
        raise InvalidEvent(f"unknown status: {status!r}")
    return doc


def parse_line(line: str | bytes) -> dict[str, Any]:
    """Parse one `.events.jsonl` line; raise `InvalidEvent` with a reason when it is not one."""
    try:
        doc = json.loads(line)
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidEvent(f"invalid JSON: {exc}") from None
    return check(doc)
