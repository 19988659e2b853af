"""The OpenAI streaming wire as vLLM speaks it, and the timing rules read off it.

Shared by the load generator and the gateway, so a number measured at either means the same.
Timing follows `vllm bench serve`, so numbers compare with the most used peer:
- TTFT: first SSE message carrying a generated token, minus the moment before sending — a chat
  delta with non-empty content, or any completions choice (its text is empty when the token is a
  special one, e.g. EOS under `ignore_eos`; it is still a token, as `vllm bench serve` counts it);
- ITL: every gap between successive content messages (kept raw, per request);
- TPOT: (e2e − TTFT) / (completion_tokens − 1), per request;
- e2e: the last message (or the stream's end) minus the moment before sending.
When a message "arrives" depends on the transport, and `StreamTiming` takes whatever clock its
caller uses (seconds; `start` and every `now` on the same one). The load generator's
kernel-timed transport (`loadgen.transport`) gives the kernel's receive timestamp of the read
that carried the message; aiohttp (https) and the gateway read `time.perf_counter()` when their
loop handles the data.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypedDict

import aiohttp

DONE = b"[DONE]"
_decode = json.JSONDecoder().decode  # str in: skips json.loads' per-call encoding sniffing


class TokenDetails(TypedDict, total=False):
    cached_tokens: int | None  # prompt tokens served from the prefix cache


class Usage(TypedDict, total=False):
    """An OpenAI `usage` object (in the last chunk of a stream, or a whole answer)."""

    prompt_tokens: int | None
    completion_tokens: int | None
    total_tokens: int | None
    prompt_tokens_details: TokenDetails | None


class Delta(TypedDict, total=False):
    role: str
    content: str | None


class Choice(TypedDict, total=False):
    """One choice of a stream chunk: a completion's `text`, a chat's `delta`."""

    index: int
    text: str
    delta: Delta
    finish_reason: str | None


class Chunk(TypedDict, total=False):
    """One `data:` message of an OpenAI stream, as vLLM sends it (`error` instead of choices
    when the server fails mid-stream)."""

    id: str
    model: str
    choices: list[Choice]
    usage: Usage | None
    error: object


@dataclass(frozen=True)
class Endpoint:
    """Which OpenAI route a request goes to, and where its text lives in a stream chunk."""

    path: str
    chat: bool

    def is_token(self, choice: Choice) -> bool:
        """Whether a stream choice carries a generated token (see the module's timing rules)."""
        if self.chat:
            return bool((choice.get("delta") or {}).get("content"))
        return "text" in choice

    def text_of(self, choice: Choice) -> str:
        if self.chat:
            return (choice.get("delta") or {}).get("content") or ""
        return choice.get("text") or ""


COMPLETIONS = Endpoint("/v1/completions", chat=False)
CHAT = Endpoint("/v1/chat/completions", chat=True)
ENDPOINTS = {"completions": COMPLETIONS, "chat": CHAT}

# Response headers by which the gateway tells a client which upstream (replica) served the
# request and why it was chosen (gateway/routing.py), and the event keys a client keeps them
# under: a run through the gateway knows each request's replica without the gateway's events.
ROUTE_HEADERS = {"x-servescope-upstream": "upstream", "x-servescope-route": "route_reason"}
ROUTE_HEADER_PREFIX = b"x-servescope-"


def route_into(event: dict[str, Any], headers: Any) -> None:
    """Copy the gateway's routing headers (a case-insensitive mapping) into `event`."""
    for header, key in ROUTE_HEADERS.items():
        if (value := headers.get(header)) is not None:
            event[key] = value


def error_class(exc: BaseException) -> str:
    """Map a client-side failure to the error classes of the event schema."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect"
    if isinstance(exc, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return "timeout"
    return "disconnect"


class StreamTiming:
    """The timing rules of the module docstring, fed one SSE message at a time.

    Both the bench client and the gateway's pass-through proxy feed it, so a number measured at
    the gateway and one measured at the client mean the same thing.
    """

    __slots__ = ("endpoint", "start", "first", "last", "gaps", "usage", "finish_reason", "done")

    def __init__(self, endpoint: Endpoint, start: float) -> None:
        self.endpoint = endpoint
        self.start = start
        self.first: float | None = None
        self.last: float | None = None
        self.gaps: list[float] = []
        self.usage: Usage | None = None
        self.finish_reason: str | None = None
        self.done = False

    def feed_line(self, line: bytes, now: float) -> Chunk | None:
        """Take one line of the stream; returns the parsed chunk (None for `[DONE]`/non-data)."""
        line = line.strip()
        if not line.startswith(b"data:"):
            return None
        data = line[5:].strip()
        if data == DONE:
            self.done = True
            return None
        chunk: Chunk = _decode(data.decode())  # the JSON object vLLM sends
        for choice in chunk.get("choices") or ():
            if self.endpoint.is_token(choice):
                if self.first is None:
                    self.first = now
                elif self.last is not None:
                    self.gaps.append((now - self.last) * 1000.0)
                self.last = now
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        return chunk

    def finish(self, event: dict[str, Any], end: float) -> dict[str, Any]:
        """Fill e2e, TTFT, TPOT, ITL, finish reason and usage into `event` (status `ok`)."""
        e2e = (end - self.start) * 1000.0
        event["e2e_ms"] = e2e
        if self.first is not None:
            event["ttft_ms"] = (self.first - self.start) * 1000.0
        event["itl_ms"] = self.gaps
        event["finish_reason"] = self.finish_reason
        if self.usage:
            usage_into(event, self.usage)
        completion = event.get("completion_tokens")
        # Every ok stream carries `tpot_ms`: null when the client saw nothing of the decode (one
        # token, or every token at once: one chunk, or chunks of one read, as a busy server
        # flushes a whole answer), rather than a 0 or a missing key (docs/design.md, "TPOT").
        tpot = None
        if self.first is not None and completion and completion > 1 and any(self.gaps):
            tpot = (e2e - event["ttft_ms"]) / (completion - 1)
        event["tpot_ms"] = tpot
        event["status"] = "ok"
        return event


def usage_into(event: dict[str, Any], usage: Usage) -> None:
    """Copy an OpenAI `usage` object into the event's token fields."""
    event["prompt_tokens"] = usage.get("prompt_tokens")
    event["completion_tokens"] = usage.get("completion_tokens")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is not None:
        event["cached_tokens"] = cached
        event["cache_hit"] = cached > 0


def mark_failed(
    event: dict[str, Any],
    start: float,
    kind: str,
    status: str,
    detail: str,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """Mark `event` failed; its e2e runs from `start` to now on `clock` (the caller's clock)."""
    event["e2e_ms"] = (clock() - start) * 1000.0
    event["status"] = status
    event["error"] = kind
    event["finish_reason"] = "error"
    event["error_detail"] = detail
    return event
