"""The load generator's streaming client: one request to an OpenAI-compatible server, timed.

The timing rules are the wire's (`servescope.wire.stream`); this module only carries requests
there and back. Over `http://` it uses the kernel-timed transport (`loadgen.transport`): the
server as seen on the wire, without the client's own wait for its event loop; over `https://`
it uses aiohttp, whose times are read when the loop handles the data.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable
from dataclasses import replace
from typing import Any, cast

import aiohttp
from opentelemetry.trace import SpanKind, Tracer

from servescope.loadgen.request import ClientEvent, RequestBody
from servescope.loadgen.transport import Http1Pool, StreamCall, stream_request_http1
from servescope.wire import tracing
from servescope.wire.stream import (
    Endpoint,
    StreamTiming,
    error_class,
    mark_failed,
    route_into,
)


def stream_request(
    session: aiohttp.ClientSession | Http1Pool,
    base_url: str,
    endpoint: Endpoint,
    payload: RequestBody,
    request_id: str,
    *,
    headers: dict[str, str] | None = None,
    timeout_s: float | None = None,
    keep_text: bool = False,
    tracer: Tracer | None = None,
) -> Awaitable[ClientEvent]:
    """Send one streaming request and return (an awaitable of) its event (schema of
    docs/architecture.md).

    With `keep_text` the generated text comes back too, as `output_text` (an agent's next turn
    quotes it); callers pop it before storing the event. With a `tracer` (see
    `wire.tracing.tracer_from_env`) the request gets a client span whose `traceparent` goes
    upstream and whose trace id the event keeps; a `traceparent` in `headers` is recorded too.
    Without either, the request costs exactly what it did before tracing existed.

    `session` is an aiohttp session (any URL), or a `transport.Http1Pool` for `base_url` (plain
    http: about half the client CPU per request and kernel arrival stamps, what `bench run` uses
    so the client stays far from being the bottleneck and out of what it measures); both carry
    the same timing rules and give the same event.
    """
    call = StreamCall(endpoint, payload, request_id, headers, timeout_s, keep_text)
    if tracer is None and not (headers and "traceparent" in headers):
        return _stream_request(session, base_url, call)
    return _traced_request(tracer, session, base_url, call)


async def _traced_request(
    tracer: Tracer | None,
    session: aiohttp.ClientSession | Http1Pool,
    base_url: str,
    call: StreamCall,
) -> ClientEvent:
    if tracer is None:  # the caller's own trace context
        event = await _stream_request(session, base_url, call)
        if trace_id := tracing.trace_id_from_headers(call.headers or {}):
            event["trace_id"] = trace_id
        return event
    operation = "chat" if call.endpoint.chat else "text_completion"
    model = call.payload.get("model")
    span, carrier = tracing.start_request_span(
        tracer,
        f"{operation} {model}" if model else operation,
        kind=SpanKind.CLIENT,
        attributes=tracing.genai_attributes(operation, model, call.request_id),
        parent_headers=call.headers,
    )
    try:
        traced = replace(call, headers={**(call.headers or {}), **carrier})
        event = await _stream_request(session, base_url, traced)
    except BaseException:
        span.end()
        raise
    event["trace_id"] = tracing.trace_id_of(span)
    tracing.end_request_span(span, event)
    return event


async def _stream_request(
    session: aiohttp.ClientSession | Http1Pool, base_url: str, call: StreamCall
) -> ClientEvent:
    if not isinstance(session, aiohttp.ClientSession):
        return await stream_request_http1(session, call)
    # wire.stream's rules fill the event, under ClientEvent's keys
    return cast(ClientEvent, await _exchange(session, base_url, call))


async def _exchange(
    session: aiohttp.ClientSession, base_url: str, call: StreamCall
) -> dict[str, Any]:
    endpoint, event = call.endpoint, call.event()
    start = time.perf_counter()
    timing = StreamTiming(endpoint, start)
    pieces: list[str] = []
    try:
        async with session.post(
            base_url + endpoint.path,
            json=call.body(),
            headers=call.send_headers(),
            timeout=aiohttp.ClientTimeout(total=call.timeout_s),
        ) as resp:
            event["http_status"] = resp.status
            route_into(event, resp.headers)
            if resp.status != 200:
                text = (await resp.text())[:500]
                kind = "http_5xx" if resp.status >= 500 else "http_4xx"
                return mark_failed(event, start, kind, "error", text)
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
                        return mark_failed(event, start, "http_5xx", "error", detail)
                    if call.keep_text and chunk is not None:
                        pieces.extend(endpoint.text_of(c) for c in chunk.get("choices") or ())
                if timing.done:
                    break
    except (TimeoutError, aiohttp.ClientError) as exc:
        kind = error_class(exc)
        status = "timeout" if kind == "timeout" else "error"
        return mark_failed(event, start, kind, status, repr(exc))
    end = time.perf_counter()
    if not timing.done:
        return mark_failed(event, start, "disconnect", "error", "stream ended before [DONE]")
    if call.keep_text:
        event["output_text"] = "".join(pieces)
    return timing.finish(event, end)


async def get_json(
    session: aiohttp.ClientSession, url: str, payload: dict[str, Any] | None = None
) -> Any:
    """GET (or POST when `payload` is given) a JSON resource, raising on a non-2xx answer."""
    method = session.post(url, json=payload) if payload is not None else session.get(url)
    async with method as resp:
        resp.raise_for_status()
        return await resp.json()
