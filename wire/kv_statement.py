"""vLLM's own start-up statement of its KV-cache capacity, read from a log message.

vLLM (0.32, `v1/core/kv_cache_utils.py`) logs once per start:
`CPU KV cache size: 524,288 tokens, Maximum concurrency for 4,096 tokens per request: 128.00x`
(`GPU …` on CUDA; older versions log the two halves as separate lines, `GPU KV cache size:
N tokens` and `Maximum concurrency for L tokens per request: Xx`). The launcher (loadgen) and the
collector both record it, next to servescope's own arithmetic (`servescope capacity`); this one
parser serves both, as `wire.exposition` serves both their `/metrics` scrapes.
"""

from __future__ import annotations

import re
from typing import TypedDict

_SIZE = re.compile(
    r"\b(?P<device>[A-Za-z]+(?: \+ host)?) KV cache size: (?P<tokens>\d[\d,]*) tokens"
)
_CONCURRENCY = re.compile(
    r"Maximum concurrency for (?P<len>\d[\d,]*) tokens per request: (?P<x>\d[\d.]*)x"
)


class KvStatement(TypedDict, total=False):
    """What vLLM states (the store keeps it in a session's notes as `store.notes.KvStatement`,
    the same keys: the store imports nothing of ours, and a test holds the two alike)."""

    kv_cache_device: str  # where vLLM put the cache: `CPU`, `GPU`, `CPU + host`…
    kv_cache_tokens: int  # tokens the cache holds
    max_model_len: int  # the request length the concurrency is stated for
    max_concurrency: float  # requests of that length the cache holds at once


def kv_cache_statement(message: str) -> KvStatement | None:
    """The numbers one log message states: `kv_cache_tokens` and `kv_cache_device` (`CPU`,
    `GPU`…), and/or `max_model_len` and `max_concurrency`; None when it states neither."""
    found = KvStatement()
    if size := _SIZE.search(message):
        found["kv_cache_device"] = size["device"]
        found["kv_cache_tokens"] = int(size["tokens"].replace(",", ""))
    if conc := _CONCURRENCY.search(message):
        try:
            found["max_concurrency"] = float(conc["x"])
        except ValueError:
            return found or None
        found["max_model_len"] = int(conc["len"].replace(",", ""))
    return found or None


def kv_cache_from_log(text: str) -> KvStatement | None:
    """The last complete statement in a log's text (a restarted server appends a new one)."""
    merged = KvStatement()
    last: KvStatement | None = None
    for line in text.splitlines():
        if "KV cache size" not in line and "Maximum concurrency" not in line:
            continue
        stated = kv_cache_statement(line)
        if not stated:
            continue
        if "kv_cache_tokens" in stated:
            merged = KvStatement()
        merged.update(stated)
        last = merged.copy()
    return last
