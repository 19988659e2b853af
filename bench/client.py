"""The streaming OpenAI-compatible client and its timing rules (shared by bench and gateway).

Timing follows `vllm bench serve`, so numbers compare with the most used peer:
- TTFT: first SSE message carrying a generated token, minus the moment before sending — a chat
  delta with non-empty content, or any completions choice (its text is empty when the token is a
  special one, e.g. EOS under `ignore_eos`; it is still a token, as `vllm bench serve` counts it);
- ITL: every gap between successive content messages (kept raw, per request);
- TPOT: (e2e − TTFT) / (completion_tokens − 1), per request;
- e2e: the last message (or the stream's end) minus the moment before sending.

When a message "arrives" depends on the transport, and `StreamTiming` takes whatever clock its
caller uses (seconds; `start` and every `now` on the same one). `bench.http1` (what `bench run`
uses for http:// targets) gives the kernel's receive timestamp of the read that carried the
message and reads the clock right before the request goes to the kernel: the server as seen on
the wire, without the client's own wait for its event loop (see its docstring). The aiohttp path
(https) and the gateway read `time.perf_counter()` when their loop handles the data.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
from opentelemetry.trace import SpanKind, Tracer

from bench import tracing

if TYPE_CHECKING:
    from bench.http1 import Http1Pool

DONE = b"[DONE]"
_decode = json.JSONDecoder().decode  # str in: skips json.loads' per-call encoding sniffing


@dataclass(frozen=True)
class Endpoint:
    """Which OpenAI route a request goes to, and where its text lives in a stream chunk."""

    path: str
    chat: bool

    def is_token(self, choice: dict[str, Any]) -> bool:
        """Whether a stream choice carries a generated token (see the module's timing rules)."""
        if self.chat:
            return bool((choice.get("delta") or {}).get("content"))
        return "text" in choice

    def text_of(self, choice: dict[str, Any]) -> str:
        if self.chat:
            return (choice.get("delta") or {}).get("content") or ""
        return choice.get("text") or ""


COMPLETIONS = Endpoint("/v1/completions", chat=False)
CHAT = Endpoint("/v1/chat/completions", chat=True)
ENDPOINTS = {"completions": COMPLETIONS, "chat": CHAT}


def utc_now_iso() -> str:
    """Now as `2026-05-12T09:30:00.123456Z`. Built from `time_ns` with the date and time part
    cached: building a `datetime` and formatting it whole was 4 % of the gateway's CPU per
    request, while that part changes only once a second."""
    seconds, rest = divmod(time.time_ns(), 1_000_000_000)
    return f"{_utc_second(seconds)}.{rest // 1000:06d}Z"


@functools.lru_cache(maxsize=2)
def _utc_second(seconds: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))


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
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.done = False

    def feed_line(self, line: bytes, now: float) -> dict[str, Any] | None:
        """Take one line of the stream; returns the parsed chunk (None for `[DONE]`/non-data)."""
        line = line.strip()
        if not line.startswith(b"data:"):
            return None
        data = line[5:].strip()
        if data == DONE:
            self.done = True
            return None
        chunk = _decode(data.decode())
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
        if self.first is not None and completion and completion > 1:
            event["tpot_ms"] = (e2e - event["ttft_ms"]) / (completion - 1)
        event["status"] = "ok"
        return event


def usage_into(event: dict[str, Any], usage: dict[str, Any]) -> None:
    """Copy an OpenAI `usage` object into the event's token fields."""
    event["prompt_tokens"] = usage.get("prompt_tokens")
    event["completion_tokens"] = usage.get("completion_tokens")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is not None:
        event["cached_tokens"] = cached
        event["cache_hit"] = cached > 0


def stream_request(
    session: aiohttp.ClientSession | Http1Pool,
    base_url: str,
    endpoint: Endpoint,
    payload: dict[str, Any],
    request_id: str,
    *,
    headers: dict[str, str] | None = None,
    timeout_s: float | None = None,
    keep_text: bool = False,
    tracer: Tracer | None = None,
) -> Awaitable[dict[str, Any]]:
    """Send one streaming request and return (an awaitable of) its event (schema of
    docs/architecture.md).

    With `keep_text` the generated text comes back too, as `output_text` (an agent's next turn
    quotes it); callers pop it before storing the event. With a `tracer` (see
    `bench.tracing.tracer_from_env`) the request gets a client span whose `traceparent` goes
    upstream and whose trace id the event keeps; a `traceparent` in `headers` is recorded too.
    Without either, the request costs exactly what it did before tracing existed.

    `session` is an aiohttp session (any URL), or a `bench.http1.Http1Pool` for `base_url` (plain
    http: about half the client CPU per request and kernel arrival stamps, what `bench run` uses
    so the client stays far from being the bottleneck and out of what it measures); both carry
    the same timing rules and give the same event.
    """
    args = (session, base_url, endpoint, payload, request_id)
    options = {"headers": headers, "timeout_s": timeout_s, "keep_text": keep_text}
    if tracer is None and not (headers and "traceparent" in headers):
        return _stream_request(*args, **options)
    return _traced_request(tracer, *args, **options)


async def _traced_request(
    tracer: Tracer | None,
    session: aiohttp.ClientSession | Http1Pool,
    base_url: str,
    endpoint: Endpoint,
    payload: dict[str, Any],
    request_id: str,
    *,
    headers: dict[str, str] | None,
    timeout_s: float | None,
    keep_text: bool,
) -> dict[str, Any]:
    if tracer is None:  # the caller's own trace context
        event = await _stream_request(
            session, base_url, endpoint, payload, request_id,
            headers=headers, timeout_s=timeout_s, keep_text=keep_text,
        )  # fmt: skip
        if trace_id := tracing.trace_id_from_headers(headers or {}):
            event["trace_id"] = trace_id
        return event
    operation = "chat" if endpoint.chat else "text_completion"
    model = payload.get("model")
    span, carrier = tracing.start_request_span(
        tracer,
        f"{operation} {model}" if model else operation,
        kind=SpanKind.CLIENT,
        attributes=tracing.genai_attributes(operation, model, request_id),
        parent_headers=headers,
    )
    try:
        event = await _stream_request(
            session, base_url, endpoint, payload, request_id,
            headers={**(headers or {}), **carrier}, timeout_s=timeout_s, keep_text=keep_text,
        )  # fmt: skip
    except BaseException:
        span.end()
        raise
    event["trace_id"] = tracing.trace_id_of(span)
    tracing.end_request_span(span, event)
    return event


async def _stream_request(
    session: aiohttp.ClientSession | Http1Pool,
    base_url: str,
    endpoint: Endpoint,
    payload: dict[str, Any],
    request_id: str,
    *,
    headers: dict[str, str] | None = None,
    timeout_s: float | None = None,
    keep_text: bool = False,
) -> dict[str, Any]:
    if not isinstance(session, aiohttp.ClientSession):
        from bench.http1 import stream_request_http1  # bench.http1 imports this module

        return await stream_request_http1(
            session, endpoint, payload, request_id,
            headers=headers, timeout_s=timeout_s, keep_text=keep_text,
        )  # fmt: skip
    body = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    send_headers = {"X-Request-Id": request_id, **(headers or {})}
    event: dict[str, Any] = {"request_id": request_id, "ts": utc_now_iso()}
    start = time.perf_counter()
    timing = StreamTiming(endpoint, start)
    pieces: list[str] = []
    try:
        async with session.post(
            base_url + endpoint.path,
            json=body,
            headers=send_headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            event["http_status"] = resp.status
            if resp.status != 200:
                text = (await resp.text())[:500]
                kind = "http_5xx" if resp.status >= 500 else "http_4xx"
                return _failed(event, start, kind, "error", text)
            # Whole network reads, split here: one await per read instead of one per SSE line
            # (3x cheaper), and every line of a read is stamped with the read's arrival time.
            rest = b""
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                *lines, rest = (rest + data).split(b"\n")
                for raw in lines:
                    chunk = timing.feed_line(raw, now)
                    if timing.done:
                        break
                    if chunk is not None and "error" in chunk:
                        detail = json.dumps(chunk["error"])
                        return _failed(event, start, "http_5xx", "error", detail)
                    if keep_text and chunk is not None:
                        pieces.extend(endpoint.text_of(c) for c in chunk.get("choices") or ())
                if timing.done:
                    break
    except (TimeoutError, aiohttp.ClientError) as exc:
        kind = error_class(exc)
        return _failed(event, start, kind, "timeout" if kind == "timeout" else "error", repr(exc))
    end = time.perf_counter()
    if not timing.done:
        return _failed(event, start, "disconnect", "error", "stream ended before [DONE]")
    if keep_text:
        event["output_text"] = "".join(pieces)
    return timing.finish(event, end)


def _failed(
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


async def get_json(
    session: aiohttp.ClientSession, url: str, payload: dict[str, Any] | None = None
) -> Any:
    """GET (or POST when `payload` is given) a JSON resource, raising on a non-2xx answer."""
    method = session.post(url, json=payload) if payload is not None else session.get(url)
    async with method as resp:
        resp.raise_for_status()
        return await resp.json()
