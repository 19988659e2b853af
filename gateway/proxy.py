"""Pass-through of one admitted request to an upstream, chunk by chunk, timed at the gateway.

Bytes go to the client as soon as the upstream hands them over (no buffering); a copy of each
SSE line feeds `bench.client.StreamTiming`, so the gateway's TTFT/TPOT/ITL follow the same rules
as the bench client. The client's response starts with the upstream's first body bytes: until
then nothing is committed, and a failed upstream can be replaced by the fallback transparently.
After that a failure ends the stream with an OpenAI-style `data: {"error": …}` message.

Timeouts are phases: `prefill_timeout_s` runs from the upstream send to the first content
chunk, `decode_timeout_s` from the first content chunk to the end of the stream.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from bench.client import Endpoint, StreamTiming, error_class, usage_into

CONNECT_TIMEOUT_S = 5.0


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

    request: web.Request
    session: aiohttp.ClientSession
    url: str
    endpoint: Endpoint
    body: bytes
    headers: dict[str, str]
    stream: bool
    timing: StreamTiming
    prefill_timeout_s: float | None
    decode_timeout_s: float | None


async def forward(attempt: Attempt, event: dict[str, Any]) -> web.StreamResponse:
    """Send the request; fill `event`; return the response already written to the client.

    Raises `UpstreamFailed` only while nothing has reached the client.
    """
    a = attempt
    try:
        upstream = await a.session.post(
            a.url + a.endpoint.path,
            data=a.body,
            headers=a.headers,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S),
        )
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise UpstreamFailed(error_class(exc), f"upstream {a.url}: {exc!r}") from exc
    try:
        if upstream.status >= 500:
            text = (await upstream.read())[:500].decode(errors="replace")
            raise UpstreamFailed("http_5xx", text, upstream.status)
        if upstream.status != 200 or not a.stream:
            response: web.StreamResponse = await _whole(a, upstream, event)
            upstream.release()
            return response
        response = await _relay(a, upstream, event)
    except BaseException:
        upstream.close()  # drops the connection: vLLM aborts the request and frees its KV cache
        raise
    if upstream.content.at_eof():
        upstream.release()  # back to the pool
    elif not a.timing.done:  # a timeout or a broken stream: abort the upstream request
        upstream.close()
    else:  # the chunked body's terminator may still be on its way: drain it off the hot path
        task = asyncio.create_task(_drain(upstream))
        _DRAINING.add(task)
        task.add_done_callback(_DRAINING.discard)
    return response


_DRAINING: set[asyncio.Task[None]] = set()


async def _drain(upstream: aiohttp.ClientResponse) -> None:
    try:
        await asyncio.wait_for(upstream.read(), 10)
    except (TimeoutError, aiohttp.ClientError):
        upstream.close()
    else:
        upstream.release()


async def _whole(
    a: Attempt, upstream: aiohttp.ClientResponse, event: dict[str, Any]
) -> web.Response:
    body = await upstream.read()
    end = time.perf_counter()
    event["http_status"] = upstream.status
    event["e2e_ms"] = (end - a.timing.start) * 1000.0
    if upstream.status == 200:
        event["status"] = "ok"
        try:
            doc = json.loads(body)
            usage_into(event, doc.get("usage") or {})
            reasons = [c.get("finish_reason") for c in doc.get("choices") or ()]
            event["finish_reason"] = next((r for r in reasons if r), None)
        except (ValueError, AttributeError):
            pass
    else:
        event.update(status="error", error="http_4xx", finish_reason="error")
        event["error_detail"] = body[:500].decode(errors="replace")
    return web.Response(
        body=body,
        status=upstream.status,
        headers={"Content-Type": upstream.headers.get("Content-Type", "application/json")},
    )


def _error_chunk(message: str, code: int) -> bytes:
    doc = {"error": {"message": message, "type": "upstream_error", "param": None, "code": code}}
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


async def _relay(
    a: Attempt, upstream: aiohttp.ClientResponse, event: dict[str, Any]
) -> web.StreamResponse:
    response: web.StreamResponse | None = None
    timing = a.timing
    pending = b""
    end = 0.0
    stream_error: Any = None
    loop = asyncio.get_running_loop()
    sent_at = loop.time()
    try:
        async with asyncio.timeout_at(
            sent_at + a.prefill_timeout_s if a.prefill_timeout_s else None
        ) as deadline:
            while True:
                data = await upstream.content.readany()
                if not data:
                    break
                now = time.perf_counter()
                had_first = timing.first is not None
                if pending:
                    data = pending + data
                cut = data.rfind(b"\n") + 1  # only whole lines go out: an error chunk written
                pending = data[cut:]  # after a failure never lands inside a half-sent message
                if not cut:
                    continue
                data = data[:cut]
                for line in data.split(b"\n"):
                    try:
                        chunk = timing.feed_line(line, now)
                    except ValueError:  # not JSON: passed through, not timed
                        continue
                    if chunk is not None and "error" in chunk:
                        stream_error = chunk["error"]
                if not had_first and timing.first is not None:
                    deadline.reschedule(
                        loop.time() + a.decode_timeout_s if a.decode_timeout_s else None
                    )
                if response is None:
                    response = web.StreamResponse(
                        status=200,
                        headers={
                            "Content-Type": upstream.headers.get(
                                "Content-Type", "text/event-stream"
                            ),
                            "Cache-Control": "no-cache",
                            "X-Request-Id": a.headers["X-Request-Id"],
                        },
                    )
                    await _to_client(response.prepare(a.request))
                if timing.done:  # last bytes and the end of the chunked body in one send
                    await _to_client(response.write_eof(data))
                    end = now
                    break
                await _to_client(response.write(data))
    except TimeoutError:
        phase = "decode" if timing.first is not None else "prefill"
        limit = a.decode_timeout_s if phase == "decode" else a.prefill_timeout_s
        detail = f"{phase} timeout: {limit:g} s"
        event.update(timeout_phase=phase)
        return await _fail(a, response, event, "timeout", "timeout", detail, 504)
    except aiohttp.ClientError as exc:  # the upstream broke the stream
        return await _fail(a, response, event, "error", "disconnect", f"upstream: {exc!r}", 502)
    event["http_status"] = 200
    if response is None:
        raise UpstreamFailed("disconnect", "upstream closed before sending anything", 502)
    if not timing.done:
        return await _fail(
            a, response, event, "error", "disconnect", "upstream ended before [DONE]", 502
        )
    timing.finish(event, end)
    if stream_error is not None:  # the upstream reported a failure inside the stream
        code = stream_error.get("code") if isinstance(stream_error, dict) else None
        kind = "http_4xx" if isinstance(code, int) and 400 <= code < 500 else "http_5xx"
        event.update(status="error", error=kind, finish_reason="error")
        event["error_detail"] = json.dumps(stream_error)[:500]
    return response


async def _fail(
    a: Attempt,
    response: web.StreamResponse | None,
    event: dict[str, Any],
    status: str,
    kind: str,
    detail: str,
    code: int,
) -> web.StreamResponse:
    """End a broken stream cleanly, or raise for the fallback when nothing was sent yet."""
    if response is None:
        if kind != "timeout":
            raise UpstreamFailed(kind, detail, code)
        event.update(status=status, error=kind, finish_reason="error", error_detail=detail)
        event["http_status"] = code
        event["e2e_ms"] = (time.perf_counter() - a.timing.start) * 1000.0
        return web.json_response(
            {"error": {"message": detail, "type": "timeout", "param": None, "code": code}},
            status=code,
        )
    event.update(status=status, error=kind, finish_reason="error", error_detail=detail)
    event["http_status"] = 200
    event["e2e_ms"] = (time.perf_counter() - a.timing.start) * 1000.0
    await _to_client(response.write(_error_chunk(detail, code)))
    await _to_client(response.write_eof())
    return response


async def _to_client(write: Any) -> None:
    try:
        await write
    except (ConnectionError, aiohttp.ClientConnectionResetError) as exc:
        raise ClientGone(repr(exc)) from exc
