"""One request as the load generator sends it and records it: the body it posts (`RequestBody`)
and the event it keeps of the answer (`ClientEvent`). Types only; the client (`loadgen/client.py`
over `loadgen/transport.py`) fills them, the scheduler and the recorder read them.
"""

from __future__ import annotations

from typing import Required, TypedDict

from servescope.store.validation import EventDoc

Prompt = str | list[int]  # text, or token ids (a prompt made exact by the server's tokenizer)


class Message(TypedDict):
    """One chat message."""

    role: str
    content: str


class RequestBody(TypedDict, total=False):
    """The OpenAI body of one completions (`prompt`) or chat (`messages`) request; `max_tokens`
    with `ignore_eos` makes the output length exact."""

    model: Required[str]
    max_tokens: int
    ignore_eos: bool
    temperature: float
    prompt: Prompt
    messages: list[Message]


class ClientEvent(EventDoc, total=False):
    """A request's event as the client records it: the contract's keys (`EventDoc`: timings,
    tokens, status), and what only the client knows — the plan it came from, its place in an
    agent session, its schedule in an open loop, the gateway's routing headers."""

    error_detail: str  # what a failure said
    upstream: str  # the gateway's `x-servescope-upstream`
    route_reason: str  # … and `x-servescope-route`
    output_text: str  # with `keep_text`: an agent's next turn quotes it; popped before storing
    request_class: str
    plan_index: int
    prompt_sha: str  # `prompts.prompt_digest` of the body
    session: int  # an agent session's unit index …
    turn: int  # … and the turn in it
    intended_ts: str  # an open loop's scheduled send time
    schedule_lag_ms: float  # … and how late the send was
