"""The merge rules of one request's records: the pieces of a request (a client's record, the
gateway's, vLLM's trace spans and log lines) arrive in any order, some more than once, and are
stored as one row. `merge_docs` gives the same row whatever their order and however often each
comes; a request served in parts (n > 1, a list of prompts) keeps each part's figures and the
request's summed up from them.
"""

from __future__ import annotations

import math
from typing import Any

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


def merge_docs(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
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
    if _parted(old) or _parted(new) or _two_parts(old, new):
        return _merge_parts(old, new)
    return _merge_fields(old, new)


def _merge_fields(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    merged = dict(old)
    for key, value in new.items():
        if value is None and merged.get(key) is not None:
            continue
        if key in FIRST_WINS and merged.get(key) is not None:
            continue
        merged[key] = value
    return merged


def _part_id(doc: dict[str, Any]) -> str | None:
    part = doc.get(PART_KEY)
    return part if isinstance(part, str) and part and _summable(doc) else None


def _summable(fields: dict[str, Any]) -> bool:
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


def _parted(doc: dict[str, Any]) -> bool:
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


def _two_parts(old: dict[str, Any], new: dict[str, Any]) -> bool:
    a, b = _part_id(old), _part_id(new)
    return a is not None and b is not None and a != b


def _split(doc: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """A record as (what it says of the whole request, its parts by part key)."""
    if _parted(doc):  # its figures were summed from its parts, or said by a whole-request record
        base = {k: v for k, v in doc.items() if k != PARTS}
        return base, {k: dict(p) for k, p in doc[PARTS].items()}
    part = _part_id(doc)
    if part is None:  # a client's, a log's record: about the whole request
        return dict(doc), {}
    fields = {k: doc[k] for k in (PART_KEY, *PART_FIELDS) if doc.get(k) is not None}
    base = {k: v for k, v in doc.items() if k != PART_KEY and k not in PART_FIELDS}
    return base, {part: fields}


def _merge_parts(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
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
        summed["n"] = max(summed["n"], said_n)
    return {**base, **summed, PARTS: parts}


def _sum_parts(parts: dict[str, dict[str, Any]]) -> dict[str, Any]:
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
    out: dict[str, Any] = {}

    def present(key: str) -> list[Any]:
        return [p[key] for p in values if p.get(key) is not None]

    if tokens := present("completion_tokens"):
        out["completion_tokens"] = sum(tokens)
    prompts: dict[str, int] = {}
    samples: dict[str, int] = {}
    for key, p in zip(keys, values, strict=True):
        prompt = key.rpartition("#")[0] or key
        samples[prompt] = samples.get(prompt, 0) + 1
        if p.get("prompt_tokens") is not None:
            prompts[prompt] = max(prompts.get(prompt, 0), p["prompt_tokens"])
    if prompts:
        out["prompt_tokens"] = sum(prompts.values())
    for key in ("server_ts", "queue_ms", "server_ttft_ms"):
        if found := present(key):
            out[key] = min(found)
    first = min(
        (k for k, p in zip(keys, values, strict=True) if p.get("server_ttft_ms") is not None),
        key=lambda k: (parts[k]["server_ttft_ms"], k),
        default=None,
    )
    if first is not None and parts[first].get("prefill_ms") is not None:
        out["prefill_ms"] = parts[first]["prefill_ms"]
    for key in ("server_e2e_ms", "decode_ms", "inference_ms"):
        if found := present(key):
            out[key] = max(found)
    tpots = [
        p["decode_ms"] / (p["completion_tokens"] - 1)
        for p in values
        if p.get("decode_ms") is not None and (p.get("completion_tokens") or 0) > 1
    ]
    if tpots:
        out["server_tpot_ms"] = sum(tpots) / len(tpots)
    out["n"] = max(samples.values())
    out["vllm_request_id"] = min(samples)
    if found := present("trace_id"):
        out["trace_id"] = found[0]
    return out
