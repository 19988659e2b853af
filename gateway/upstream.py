"""A lean HTTP/1.1 client for the proxy path: keep-alive connections per upstream, responses
parsed by `httptools` (the C parser uvicorn uses), body bytes handed over as they arrive.

Why not aiohttp's client: on the proxy path it costs the gateway markedly more CPU per request
(docs/decisions/0001-own-http-stack.md; `benchmarks/bench_gateway.py --vs-aiohttp-client`
measures it). Everything off the hot path (`/tokenize`, `/version`) still uses aiohttp.

Closing a response before its end drops the connection, which is how vLLM learns that the
client went away: it aborts the request and frees its KV cache.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import cast
from urllib.parse import urlsplit

import httptools

CONNECT_TIMEOUT_S = 5.0
HIGH_WATER = 1 << 18  # buffered body bytes before the socket stops being read (backpressure)


class UpstreamError(Exception):
    """The upstream failed; `kind` is the event's error class (`connect` or `disconnect`)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self._headers: dict[str, str] = {}

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream connection's transport: asyncio's is a Transport, uvloop's has the same methods
        # without subclassing it, so it is declared rather than checked
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._lost(f"unparseable response: {exc}")
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._lost(f"connection closed by the upstream{f': {exc!r}' if exc else ''}")

    def _lost(self, detail: str) -> None:
        if self.response is not None and not self.response.complete:
            self.response._fail(UpstreamError("disconnect", detail))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self.response is not None:
            self.response._start(self.parser.get_status_code(), self._headers)

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._feed(body)

    def on_message_complete(self) -> None:
        if self.response is not None:
            self.response._finish(self.parser.should_keep_alive())

    # use
    def send(self, head: bytes, body: bytes) -> UpstreamResponse:
        assert self.transport is not None
        self._headers = {}
        self.parser = httptools.HttpResponseParser(self)
        self.response = UpstreamResponse(self)
        self.transport.write(head + body)
        return self.response

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class UpstreamResponse:
    """Status, headers, and the body as it arrives (de-chunked)."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status = 0
        self.headers: dict[str, str] = {}
        self.complete = False
        self._keep_alive = False
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._started = asyncio.get_running_loop().create_future()
        self.done_with = False

    # fed by the connection
    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _start(self, status: int, headers: dict[str, str]) -> None:
        self.status, self.headers = status, headers
        if not self._started.done():
            self._started.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER and self._conn.transport is not None:
            self._conn.transport.pause_reading()
        self._wake()

    def _finish(self, keep_alive: bool) -> None:
        self.complete = True
        self._keep_alive = keep_alive
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        self._error = error
        if not self._started.done():
            self._started.set_exception(error)
        self._wake()

    # read by the proxy
    async def started(self) -> None:
        await self._started

    def at_eof(self) -> bool:
        return self.complete and not self._chunks

    async def readany(self) -> bytes:
        """The next body bytes (whatever has arrived, joined); b"" at the end of the body."""
        while not self._chunks:
            if self.complete:
                return b""
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
            self._waiter = None
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        if self._buffered > HIGH_WATER and self._conn.transport is not None:
            self._conn.transport.resume_reading()
        self._buffered = 0
        return data

    async def read(self) -> bytes:
        parts = []
        while data := await self.readany():
            parts.append(data)
        return b"".join(parts)

    def release(self) -> None:
        """Back to the pool when the whole response was read; otherwise the connection drops."""
        if self.done_with:
            return
        self.done_with = True
        if self.at_eof() and self._keep_alive and not self._conn.closed:
            self._conn.response = None
            self._conn.pool._idle.append(self._conn)
        else:
            self._conn.close()

    def close(self) -> None:
        """Drop the connection (aborts the upstream request when it is still running)."""
        self.done_with = True
        self._conn.close()


class UpstreamPool:
    """Keep-alive connections to one upstream base URL."""

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http":
            raise ValueError(f"the proxy path speaks plain http, got {base_url}")
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self._host_header = f"{self.host}:{self.port}".encode()
        self._idle: list[_Connection] = []

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            transport, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self), self.host, self.port),
                CONNECT_TIMEOUT_S,
            )
        except (OSError, TimeoutError) as exc:
            raise UpstreamError("connect", f"{self.host}:{self.port}: {exc!r}") from exc
        conn.transport = transport  # uvloop may call connection_made() a little later
        return conn

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> UpstreamResponse:
        """Send a POST; returns once the status line and headers are in."""
        head = b"".join(
            [
                b"POST ", path.encode(), b" HTTP/1.1\r\nHost: ", self._host_header,
                b"\r\nContent-Length: ", str(len(body)).encode(), b"\r\n",
                *(f"{k}: {v}\r\n".encode("latin-1") for k, v in headers.items()),
                b"\r\n",
            ]
        )  # fmt: skip
        while self._idle:
            conn = self._idle.pop()
            if conn.closed:
                continue
            response = conn.send(head, body)
            try:
                await response.started()
                return response
            except UpstreamError:  # the server had closed the idle connection: try a fresh one
                conn.close()
            except BaseException:  # cancelled or timed out waiting: abort the request upstream
                conn.close()
                raise
        conn = await self._connect()
        response = conn.send(head, body)
        try:
            await response.started()
        except BaseException:
            conn.close()
            raise
        return response

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
