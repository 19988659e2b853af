"""A minimal HTTP/1.1 keep-alive transport for the benchmark's hot path.

A benchmark client must not be the bottleneck it measures. aiohttp spends most of a streamed
completion's client time in its own layers (request objects, header multidicts, flow control,
one coroutine hop per line); this transport writes a pre-built request and reads the response
with plain asyncio streams: the status line and headers, then a `Content-Length` body or
`Transfer-Encoding: chunked` chunks, handed over as they arrive. Plain `http://` only — what a
benchmark against a local server needs; anything else goes through aiohttp.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from bench.client import Endpoint, StreamTiming, _failed, utc_now_iso

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]
READ_LIMIT = 2**22


class ResponseHead:
    __slots__ = ("status", "length", "chunked", "keep_alive")

    def __init__(self, status: int, length: int | None, chunked: bool, keep_alive: bool) -> None:
        self.status = status
        self.length = length
        self.chunked = chunked
        self.keep_alive = keep_alive


class ConnectFailed(ConnectionError):
    """No connection could be made: the `connect` error class (anything later: `disconnect`)."""


class StaleConnection(ConnectionError):
    """A kept-alive connection the server had closed before this request: retried, not failed."""


class Http1Pool:
    """Idle keep-alive connections to one `http://host:port`."""

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"Http1Pool serves plain http:// URLs, got {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.netloc = parts.netloc
        self.prefix = parts.path.rstrip("/")
        self._idle: list[Connection] = []

    async def acquire(self) -> tuple[Connection, bool]:
        """A connection, and whether it was reused (a reused one may turn out stale)."""
        while self._idle:
            reader, writer = self._idle.pop()
            if not writer.is_closing() and not reader.at_eof():
                return (reader, writer), True
            writer.close()
        return await asyncio.open_connection(self.host, self.port, limit=READ_LIMIT), False

    def release(self, conn: Connection) -> None:
        self._idle.append(conn)

    @staticmethod
    def discard(conn: Connection) -> None:
        conn[1].close()

    def close(self) -> None:
        while self._idle:
            self._idle.pop()[1].close()

    def request_bytes(self, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        lines = [
            f"POST {self.prefix}{path} HTTP/1.1",
            f"Host: {self.netloc}",
            "Content-Type: application/json",
            "Accept: text/event-stream",
            f"Content-Length: {len(body)}",
            *(f"{k}: {v}" for k, v in headers.items()),
        ]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def read_head(reader: asyncio.StreamReader, reused: bool) -> ResponseHead:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if reused and not exc.partial:
            raise StaleConnection("kept-alive connection closed by the server") from exc
        raise
    lines = raw.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    length: int | None = None
    chunked, keep_alive = False, not lines[0].startswith("HTTP/1.0")
    for line in lines[1:]:
        name, _, value = line.partition(":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == "content-length":
            length = int(value)
        elif name == "transfer-encoding":
            chunked = "chunked" in value
        elif name == "connection":
            keep_alive = value != "close"
    return ResponseHead(status, length, chunked, keep_alive)


async def read_body(
    reader: asyncio.StreamReader,
    head: ResponseHead,
    on_data: Callable[[bytes], bool],
) -> bool:
    """Hand the body to `on_data` as it arrives (it returns True to stop listening early; the
    body is still read to its end so the connection can be reused). Returns whether the
    connection can be kept alive."""
    listening = True
    if head.chunked:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")  # no trailers from the servers we talk to
                return head.keep_alive
            data = (await reader.readexactly(size + 2))[:-2]
            if listening and on_data(data):
                listening = False
    if head.length is not None:
        data = await reader.readexactly(head.length)
        if data:
            on_data(data)
        return head.keep_alive
    while data := await reader.read(65536):  # no length: the body ends with the connection
        if listening and on_data(data):
            listening = False
    return False


async def post(
    pool: Http1Pool,
    path: str,
    body: bytes,
    headers: dict[str, str],
    on_head: Callable[[ResponseHead], Awaitable[None] | None],
    on_data: Callable[[bytes], bool],
) -> ResponseHead:
    """POST and stream the answer to `on_data`; a stale kept-alive connection is retried once
    on a fresh one. Connection errors propagate to the caller, who classifies them."""
    payload = pool.request_bytes(path, body, headers)
    for _ in range(2):
        try:
            conn, reused = await pool.acquire()
        except OSError as exc:
            raise ConnectFailed(repr(exc)) from exc
        reader, writer = conn
        keep = False
        try:
            writer.write(payload)
            head = await read_head(reader, reused)
            result = on_head(head)
            if result is not None:
                await result
            keep = await read_body(reader, head, on_data)
            return head
        except StaleConnection:
            continue
        finally:
            if keep:
                pool.release(conn)
            else:
                pool.discard(conn)
    raise ConnectionResetError("the server closed two connections in a row before answering")


async def stream_request_http1(
    pool: Http1Pool,
    endpoint: Endpoint,
    payload: dict[str, Any],
    request_id: str,
    *,
    headers: dict[str, str] | None = None,
    timeout_s: float | None = None,
    keep_text: bool = False,
) -> dict[str, Any]:
    """`bench.client.stream_request` over this transport (what `bench run` uses against
    `http://` targets): the same timing rules (`StreamTiming`), the same event."""
    body = json.dumps({**payload, "stream": True, "stream_options": {"include_usage": True}})
    send_headers = {"X-Request-Id": request_id, **(headers or {})}
    event: dict[str, Any] = {"request_id": request_id, "ts": utc_now_iso()}
    start = time.perf_counter()
    timing = StreamTiming(endpoint, start)
    pieces: list[str] = []
    refused: list[bytes] = []
    state: dict[str, Any] = {"rest": b"", "error": None}

    def on_head(head: ResponseHead) -> None:
        event["http_status"] = head.status

    def on_data(data: bytes) -> bool:
        if event["http_status"] != 200:
            refused.append(data)
            return False
        now = time.perf_counter()
        *lines, state["rest"] = (state["rest"] + data).split(b"\n")
        for raw in lines:
            if len(raw) < 5:  # the blank lines between SSE messages
                continue
            chunk = timing.feed_line(raw, now)
            if timing.done:
                return True
            if chunk is None:
                continue
            if "error" in chunk:
                state["error"] = json.dumps(chunk["error"])
                return True
            if keep_text:
                pieces.extend(endpoint.text_of(c) for c in chunk.get("choices") or ())
        return False

    try:
        async with asyncio.timeout(timeout_s):
            await post(pool, endpoint.path, body.encode(), send_headers, on_head, on_data)
    except TimeoutError as exc:
        return _failed(event, start, "timeout", "timeout", repr(exc))
    except ConnectFailed as exc:
        return _failed(event, start, "connect", "error", str(exc))
    except (OSError, EOFError, ValueError) as exc:
        return _failed(event, start, "disconnect", "error", repr(exc))
    end = time.perf_counter()
    status = event["http_status"]
    if status != 200:
        kind = "http_5xx" if status >= 500 else "http_4xx"
        detail = b"".join(refused)[:500].decode("utf-8", "replace")
        return _failed(event, start, kind, "error", detail)
    if state["error"] is not None:
        return _failed(event, start, "http_5xx", "error", state["error"])
    if not timing.done:
        return _failed(event, start, "disconnect", "error", "stream ended before [DONE]")
    if keep_text:
        event["output_text"] = "".join(pieces)
    return timing.finish(event, end)
