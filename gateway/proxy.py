"""Pass-through of one admitted request to an upstream, chunk by chunk, timed at the gateway.

Bytes go to the client as soon as the upstream hands them over, whole SSE lines at a time (a
line split across two reads waits for its end, so an error message written after a failure
never lands inside a half-sent one); the lines of each read feed `gateway.timing.RelayTiming`
(`wire.stream.StreamTiming`'s rules, without decoding plain token messages), so the gateway's
TTFT/TPOT/ITL follow the same rules as the bench client. The client's response
starts with the upstream's first body bytes: until then nothing is committed, and a failed
upstream can be replaced by the fallback transparently. After that a failure ends the stream
with an OpenAI-style `data: {"error": …}` message.

Timeouts are phases: `prefill_timeout_s` runs from the upstream send to the first content
chunk, `decode_timeout_s` from the first content chunk to the end of the stream.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

from servescope.gateway.httpserver import Reply, Response, json_response
from servescope.gateway.timing import RelayTiming
from servescope.gateway.upstream import UpstreamError, UpstreamPool, UpstreamResponse
from servescope.wire.stream import Endpoint, Usage, usage_into

# uvloop keeps its clock and its timers in whole milliseconds, so a deadline taken from it can
# fire up to a tick before the limit measured on `perf_counter` (the clock of TTFT and e2e):
# phase deadlines get one tick more, so no phase is cut before its limit.
TICK_S = 0.001


class UpstreamFailed(Exception):
    """The upstream failed before the client saw a byte: the request may go to the fallback."""

    def __init__(self, kind: str, detail: str, http_status: int | None = None) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail
        self.http_status = http_status


class ClientGone(Exception):
    """The client closed its connection; the upstream request is closed to abort it."""


@dataclass
class Attempt:
    """One request to one upstream, and what the gateway measured."""

    reply: Reply  # the client's answer, when it is streamed
    pool: UpstreamPool
    endpoint: Endpoint
    body: bytes
    headers: dict[str, str]
    stream: bool
    timing: RelayTiming
    prefill_timeout_s: float | None
    decode_timeout_s: float | None
    route_headers: dict[str, str]  # which upstream serves and why, for the client


@dataclass
class _Relay:
    """What the stream loop has done so far (read by the failure paths)."""

    response: Response | Reply | None = None
    upstream: UpstreamResponse | None = None
    stream_error: Any = None
    end: float = 0.0


async def forward(a: Attempt, event: dict[str, Any]) -> Response | Reply:
    """Send the request; fill `event`; return the response already written to the client.

    Raises `UpstreamFailed` only while nothing has reached the client.
    """
    state = _Relay()
    try:
        if a.prefill_timeout_s is None and a.decode_timeout_s is None:
            return await _exchange(a, state, None, event)  # no timeout to set up and tear down
        loop = asyncio.get_running_loop()
        limit = a.prefill_timeout_s
        async with asyncio.timeout_at(loop.time() + limit + TICK_S if limit else None) as deadline:
            return await _exchange(a, state, deadline, event)
    except TimeoutError:
        phase = "decode" if a.timing.first is not None else "prefill"
        limit = a.decode_timeout_s if phase == "decode" else a.prefill_timeout_s
        event["timeout_phase"] = phase
        return await _fail(
            a, state, event, "timeout", "timeout", f"{phase} timeout: {limit:g} s", 504
        )
    finally:
        if state.upstream is not None:
            _finish_upstream(state.upstream, a.timing.done)


async def _exchange(
    a: Attempt, state: _Relay, deadline: asyncio.Timeout | None, event: dict[str, Any]
) -> Response | Reply:
    """The request sent and its answer relayed, under `deadline` (the phase timeouts) if any."""
    try:
        state.upstream = upstream = await a.pool.post(a.endpoint.path, a.body, a.headers)
        if upstream.status >= 500:
            text = (await upstream.read())[:500].decode(errors="replace")
            raise UpstreamFailed("http_5xx", text, upstream.status)
        if upstream.status != 200 or not a.stream:
            return await _whole(a, upstream, event)
        await _relay(a, state, deadline, event)
    except UpstreamError as exc:
        if state.response is None:
            raise UpstreamFailed(exc.kind, str(exc), 502) from exc
        return await _fail(a, state, event, "error", "disconnect", f"upstream: {exc}", 502)
    assert state.response is not None
    return state.response


def _finish_upstream(upstream: UpstreamResponse, done: bool) -> None:
    if upstream.at_eof() or not done:
        upstream.release()  # to the pool when read to the end; else dropped: vLLM aborts
    else:  # [DONE] seen, the chunked terminator still on its way: drain it off the hot path
        task = asyncio.create_task(_drain(upstream))
        _DRAINING.add(task)
        task.add_done_callback(_DRAINING.discard)


_DRAINING: set[asyncio.Task[None]] = set()


async def _drain(upstream: UpstreamResponse) -> None:
    try:
        await asyncio.wait_for(upstream.read(), 10)
    except (TimeoutError, UpstreamError):
        upstream.close()
    else:
        upstream.release()


async def _whole(a: Attempt, upstream: UpstreamResponse, event: dict[str, Any]) -> Response:
    body = await upstream.read()
    event["http_status"] = upstream.status
    event["e2e_ms"] = (time.perf_counter() - a.timing.start) * 1000.0
    if upstream.status == 200:
        event["status"] = "ok"
        try:
            doc = json.loads(body)
            usage_into(event, doc.get("usage") or Usage())
            reasons = [c.get("finish_reason") for c in doc.get("choices") or ()]
            event["finish_reason"] = next((r for r in reasons if r), None)
        except (ValueError, AttributeError):
            pass
    else:
        event.update(status="error", error="http_4xx", finish_reason="error")
        event["error_detail"] = body[:500].decode(errors="replace")
    return Response(
        upstream.status,
        body,
        {
            "Content-Type": upstream.headers.get("content-type", "application/json"),
            **a.route_headers,
        },
    )


async def _relay(
    a: Attempt, state: _Relay, deadline: asyncio.Timeout | None, event: dict[str, Any]
) -> None:
    upstream = state.upstream
    assert upstream is not None
    timing = a.timing
    pending = b""
    loop = asyncio.get_running_loop()
    while True:
        data = await upstream.readany()
        if not data:
            break
        now, now_loop = time.perf_counter(), loop.time()
        if pending:
            data = pending + data
        cut = data.rfind(b"\n") + 1
        pending = data[cut:]
        if cut and await _relay_lines(a, state, deadline, data[:cut], (now, now_loop)):
            break
    if state.response is None:
        raise UpstreamFailed("disconnect", "upstream closed before sending anything", 502)
    if not timing.done:
        await _fail(a, state, event, "error", "disconnect", "upstream ended before [DONE]", 502)
        return
    _complete(a, state, event)


async def _relay_lines(
    a: Attempt,
    state: _Relay,
    deadline: asyncio.Timeout | None,
    data: bytes,
    at: tuple[float, float],
) -> bool:
    """One read's complete lines to the client and into the timing, read `at` (perf counter,
    loop time); the decode deadline set once the first token came. True: the stream is done."""
    upstream, timing, reply = state.upstream, a.timing, a.reply
    assert upstream is not None
    now, now_loop = at
    had_first = timing.first is not None
    # The client gets the bytes before the gateway times them (the timing is the slower
    # part). Except while a prefill deadline waits for the first token: a write that waits
    # on a slow client must then already run under the decode deadline.
    timed_first = a.prefill_timeout_s is not None and not had_first
    if timed_first and (error := timing.feed(data, now)) is not None:
        state.stream_error = error
    # `data` ending in `data: [DONE]` is a stream the rules call done: last bytes and the
    # end of the chunked body go in one send.
    ends = timing.done if timed_first else data.endswith(b"data: [DONE]\n\n")
    if state.response is None:  # status and headers leave with the first bytes
        state.response = _start_reply(a, upstream)
    try:
        await _to_client(reply.write_eof(data) if ends else reply.write(data))
    finally:  # timed even when the write fails or times out: the bytes were relayed
        if not timed_first and (error := timing.feed(data, now)) is not None:
            state.stream_error = error
    if deadline is not None and not had_first and timing.first is not None:
        limit = a.decode_timeout_s
        deadline.reschedule(now_loop + limit + TICK_S if limit else None)
    if not timing.done:
        return False
    if not ends:  # [DONE] earlier in the read, or spelt otherwise
        await _to_client(reply.write_eof())
    state.end = now
    return True


def _start_reply(a: Attempt, upstream: UpstreamResponse) -> Reply:
    a.reply.start(
        200,
        {
            "Content-Type": upstream.headers.get("content-type", "text/event-stream"),
            "Cache-Control": "no-cache",
            "X-Request-Id": a.headers["X-Request-Id"],
            **a.route_headers,
        },
    )
    return a.reply


def _complete(a: Attempt, state: _Relay, event: dict[str, Any]) -> None:
    """The event of a stream the upstream ended with `[DONE]`: ok, or failed inside."""
    event["http_status"] = 200
    a.timing.finish(event, state.end)
    if state.stream_error is not None:  # the upstream reported a failure inside the stream
        error = state.stream_error
        code = error.get("code") if isinstance(error, dict) else None
        kind = "http_4xx" if isinstance(code, int) and 400 <= code < 500 else "http_5xx"
        event.update(status="error", error=kind, finish_reason="error")
        event["error_detail"] = json.dumps(error)[:500]


def _error_chunk(message: str, code: int) -> bytes:
    doc = {"error": {"message": message, "type": "upstream_error", "param": None, "code": code}}
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


async def _fail(
    a: Attempt, state: _Relay, event: dict[str, Any], status: str, kind: str, detail: str, code: int
) -> Response | Reply:
    """End a broken stream cleanly, or raise for the fallback when nothing was sent yet."""
    if state.response is None and kind != "timeout":
        raise UpstreamFailed(kind, detail, code)
    event.update(status=status, error=kind, finish_reason="error", error_detail=detail)
    event["e2e_ms"] = (time.perf_counter() - a.timing.start) * 1000.0
    if a.timing.first is not None:  # what the client did get: TTFT and the gaps so far
        event["ttft_ms"] = (a.timing.first - a.timing.start) * 1000.0
        event["itl_ms"] = a.timing.gaps
    if state.response is None:  # a timeout before any byte: a plain 504
        event["http_status"] = code
        state.response = json_response(
            {"error": {"message": detail, "type": "timeout", "param": None, "code": code}}, code
        )
        return state.response
    event["http_status"] = 200
    reply = a.reply
    await _to_client(reply.write(_error_chunk(detail, code)))
    await _to_client(reply.write_eof())
    return reply


async def _to_client(write: Any) -> None:
    try:
        await write
    except ConnectionError as exc:
        raise ClientGone(repr(exc)) from exc
