"""vLLM's request ids back to the client's `X-Request-Id`.

vLLM turns `X-Request-Id: R` into `chatcmpl-R` (chat) or `cmpl-R-<prompt index>` (completions),
and the engine adds `-<8 hex>` to the ids it logs in `Added request`. A call with `n` > 1 is
sampled by child requests `<sample index>_<parent id>` (parallel sampling), parts of the one
request the client sent. The Responses API ignores `X-Request-Id`: its ids are
`resp_<16 hex>_<prompt index>`. Requests sent without an id get a random hex id from vLLM; they
belong to no client run.
"""

from __future__ import annotations

import re

_ENGINE_SUFFIX = re.compile(r"-[0-9a-f]{8}$")
_PROMPT_INDEX = re.compile(r"-\d+$")
_SAMPLE = re.compile(r"^\d+_(?=chatcmpl-|cmpl-|resp_)")
_RESPONSE = re.compile(r"^resp_(?P<id>[0-9a-f]{16}|[0-9a-f]{32})(?:_\d+)?$")
_GENERATED = re.compile(r"^[0-9a-f]{16}$|^[0-9a-f]{32}$")
UNATTRIBUTED_RUN = "vllm-unattributed"


def client_request_id(vllm_id: str, *, engine: bool = False) -> str:
    """`chatcmpl-R` → R, `cmpl-R-0` → R, `resp_H_0` → H; a parallel sample's `1_chatcmpl-R` →
    R (one request, however many samples); with `engine`, the `-<8hex>` suffix goes first."""
    rid = _ENGINE_SUFFIX.sub("", vllm_id) if engine else vllm_id
    rid = _SAMPLE.sub("", rid)
    if rid.startswith("chatcmpl-"):
        return rid[len("chatcmpl-") :]
    if rid.startswith("cmpl-"):
        return _PROMPT_INDEX.sub("", rid[len("cmpl-") :])
    if response := _RESPONSE.match(rid):
        return response["id"]
    return rid


def is_generated(request_id: str) -> bool:
    """True for the random ids vLLM makes up when the client sent none."""
    return bool(_GENERATED.match(request_id))
