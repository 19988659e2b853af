"""The merge rules of one request's records: the pieces of a request (a client's record, the
gateway's, vLLM's trace spans and log lines) arrive in any order, some more than once, and are
stored as one row. `merge_docs` gives the same row whatever their order and however often each
comes; a request served in parts (n > 1, a list of prompts) keeps each part's figures and the
request's summed up from them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import cast

from servescope.store.validation import EventDoc

# Kept from the record first seen: where the request was first seen from, and the model name the
# client asked for (a server log names the same model by its served name).
FIRST_WINS = frozenset({"source", "model"})

# One request can be served in parts: a call with `n` > 1 by one child request per sample, a
# completions call with a list of prompts by one per prompt (and per sample of each). vLLM traces
# every part with its own `llm_request` span; a span's piece names its part in `vllm_part`:
# `<prompt>#<sample>` (the collector writes `<vLLM id of the prompt>#<span id>`), the parts
# sharing a `<prompt>` being samples of one prompt.
PART_KEY = "vllm_part"
PARTS = "parts"
# What a part's span says about that part alone: kept per part under `parts`, and summed up
# for the request (`_sum_parts`).
PART_FIELDS = (
    "server_ts",
    "trace_id",
    "queue_ms",
    "prefill_ms",
    "decode_ms",
    "inference_ms",
    "server_ttft_ms",
    "server_e2e_ms",
    "prompt_tokens",
    "completion_tokens",
)


def merge_docs(old: EventDoc, new: EventDoc) -> EventDoc:
    """Field-by-field merge of two records of one request, whatever order they arrive in.

    A later piece fills and updates fields but never erases one with a null, and the record
    keeps the `source` it was first seen from.

    A request served in several parts (pieces with different `vllm_part`s: the samples of an
    `n` > 1 call, the prompts of a completions call with a list of prompts) keeps each part's
    own figures in `parts` (keyed by part) and the request's figures summed up from them
    (`_sum_parts`), so the merge stays idempotent and order-free with parts too: the same piece
    twice, or a stored row merged again with new pieces, gives the same row. A request with
    one part is stored flat, as it always was.
    """
    a, b = dict(old), dict(new)
    if _parted(a) or _parted(b) or _two_parts(a, b):
        return _record(_merge_parts(a, b))
    return _record(_merge_fields(a, b))


def _record(fields: dict[str, object]) -> EventDoc:
    """The merge as a record: every key it has came from one of two records, each an EventDoc,
    or is a part's figure summed with the type the part had (`_summable`)."""
    return cast(EventDoc, fields)


def _merge_fields(old: Mapping[str, object], new: Mapping[str, object]) -> dict[str, object]:
    merged = dict(old)
    for key, value in new.items():
        if value is None and merged.get(key) is not None:
            continue
        if key in FIRST_WINS and merged.get(key) is not None:
            continue
        merged[key] = value
    return merged


def _part_id(doc: Mapping[str, object]) -> str | None:
    part = doc.get(PART_KEY)
    return part if isinstance(part, str) and part and _summable(doc) else None


def _summable(fields: Mapping[str, object]) -> bool:
    """The part figures of a record have the types `_sum_parts` adds and compares (a record
    from outside may hold anything under these names; it is then merged as any record)."""
    for key in PART_FIELDS:
        value = fields.get(key)
        if value is None:
            continue
        if key in ("server_ts", "trace_id"):
            ok = isinstance(value, str)
        elif key.endswith("_tokens"):
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        else:
            ok = (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and math.isfinite(value)
                and value >= 0
            )
        if not ok:
            return False
    return True


def _parted(doc: Mapping[str, object]) -> bool:
    """A row merged from several parts (as `_merge_parts` writes it, not any `parts` key a
    record from outside may hold: that one is kept verbatim like every unknown key)."""
    parts = doc.get(PARTS)
    return (
        isinstance(parts, dict)
        and len(parts) > 1
        and all(
            isinstance(p, dict) and p.get(PART_KEY) == k and _summable(p) for k, p in parts.items()
        )
    )


def _two_parts(old: Mapping[str, object], new: Mapping[str, object]) -> bool:
    a, b = _part_id(old), _part_id(new)
    return a is not None and b is not None and a != b


def _split(doc: dict[str, object]) -> tuple[dict[str, object], dict[str, dict[str, object]]]:
    """A record as (what it says of the whole request, its parts by part key)."""
    parts = doc.get(PARTS)
    if _parted(doc) and isinstance(parts, dict):  # summed from its parts, or a whole-request
        base = {k: v for k, v in doc.items() if k != PARTS}  # record's figures
        return base, {str(k): dict(p) for k, p in parts.items()}
    part = _part_id(doc)
    if part is None:  # a client's, a log's record: about the whole request
        return dict(doc), {}
    fields = {k: doc[k] for k in (PART_KEY, *PART_FIELDS) if doc.get(k) is not None}
    base = {k: v for k, v in doc.items() if k != PART_KEY and k not in PART_FIELDS}
    return base, {part: fields}


def _merge_parts(old: dict[str, object], new: dict[str, object]) -> dict[str, object]:
    old_base, old_parts = _split(old)
    new_base, new_parts = _split(new)
    base = _merge_fields(old_base, new_base)
    parts = {
        key: _merge_fields(old_parts.get(key, {}), new_parts.get(key, {}))
        for key in sorted({*old_parts, *new_parts})
    }
    summed = _sum_parts(parts)
    said_n = base.get("n")  # a log line's `n` (the request's), or what a stored row said
    if isinstance(said_n, int) and not isinstance(said_n, bool):
        summed["n"] = max(_int(summed, "n"), said_n)
    return {**base, **summed, PARTS: parts}


def _num(part: Mapping[str, object], key: str) -> float | None:
    """A part's figure (`_summable` made it a number >= 0, when it has one)."""
    value = part.get(key)
    return value if isinstance(value, int | float) else None


def _int(part: Mapping[str, object], key: str) -> int:
    value = part.get(key)
    return value if isinstance(value, int) else 0


def _sum_parts(parts: dict[str, dict[str, object]]) -> dict[str, object]:
    """The request's figures from its parts, as the API's `usage` and a client see them (each
    replaces what a single part or a whole-request record said; a figure no part has is kept).

    - `completion_tokens`: the sum over parts (usage counts every sample's tokens);
    - `prompt_tokens`: once per prompt (the part key's `<prompt>`), summed over prompts: the
      samples of one prompt share it, and usage counts it once per prompt;
    - `server_ttft_ms`, `queue_ms`, `server_ts`: the earliest part's (the client's first token
      is the first any part produced; the request waited until its first part ran);
      `prefill_ms` that first part's; `server_e2e_ms`, `decode_ms`, `inference_ms`: the
      longest part's (the response ends with its last part);
    - `server_tpot_ms`: the mean of the parts' own (vLLM's TPOT is a sample's: decode time over
      its tokens after the first; the summed tokens over the longest decode would halve it);
    - `n`: samples per prompt (a child's span says 1), or the `n` a log line gave, the larger;
    - `vllm_request_id` the first prompt's, `trace_id` the first part's, in part-key order (one
      value whatever order the parts came in).
    """
    keys = sorted(parts)
    values = [parts[k] for k in keys]
    out = _summed_tokens(keys, values)
    out.update(_timings(parts))
    tpots = [
        decode / (tokens - 1)
        for p in values
        if (decode := _num(p, "decode_ms")) is not None
        and (tokens := _int(p, "completion_tokens")) > 1
    ]
    if tpots:
        out["server_tpot_ms"] = sum(tpots) / len(tpots)
    samples: dict[str, int] = {}
    for key in keys:
        prompt = _prompt(key)
        samples[prompt] = samples.get(prompt, 0) + 1
    out["n"] = max(samples.values())
    out["vllm_request_id"] = min(samples)
    if traces := [p["trace_id"] for p in values if p.get("trace_id") is not None]:
        out["trace_id"] = traces[0]
    return out


def _prompt(part: str) -> str:
    """The prompt a part key names (`<prompt>#<sample>`, or the key itself)."""
    return part.rpartition("#")[0] or part


def _summed_tokens(keys: list[str], values: list[dict[str, object]]) -> dict[str, object]:
    """`completion_tokens` summed over parts, `prompt_tokens` once per prompt."""
    out: dict[str, object] = {}
    if tokens := [t for p in values if (t := _num(p, "completion_tokens")) is not None]:
        out["completion_tokens"] = sum(tokens)
    prompts: dict[str, int] = {}
    for key, p in zip(keys, values, strict=True):
        if p.get("prompt_tokens") is not None:
            prompt = _prompt(key)
            prompts[prompt] = max(prompts.get(prompt, 0), _int(p, "prompt_tokens"))
    if prompts:
        out["prompt_tokens"] = sum(prompts.values())
    return out


def _timings(parts: dict[str, dict[str, object]]) -> dict[str, object]:
    """The earliest part's start figures, the longest part's end figures."""
    out: dict[str, object] = {}
    if stamps := [s for p in parts.values() if isinstance(s := p.get("server_ts"), str)]:
        out["server_ts"] = min(stamps)
    for key in ("queue_ms", "server_ttft_ms"):
        if found := [x for p in parts.values() if (x := _num(p, key)) is not None]:
            out[key] = min(found)
    ttfts = {k: x for k, p in parts.items() if (x := _num(p, "server_ttft_ms")) is not None}
    first = min(ttfts, key=lambda k: (ttfts[k], k), default=None)
    if first is not None and parts[first].get("prefill_ms") is not None:
        out["prefill_ms"] = parts[first]["prefill_ms"]
    for key in ("server_e2e_ms", "decode_ms", "inference_ms"):
        if found := [x for p in parts.values() if (x := _num(p, key)) is not None]:
            out[key] = max(found)
    return out
