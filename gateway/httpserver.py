"""A lean HTTP/1.1 server for the gateway: requests parsed by `httptools` (the C parser uvicorn
uses), one `asyncio.Protocol` per connection, one handler task per request.

Why not aiohttp's server: behind it every proxied request paid for a request object with
multidicts and a URL, a router, middleware plumbing, a payload stream and a response writer;
that was about half of the gateway's CPU per request, and benchmarks/bench_gateway.py holds the
gateway to a fraction of a millisecond. The gateway needs little of HTTP: small request bodies
read whole, answers either whole (`Response`) or streamed chunk by chunk (`Reply`).

What the protocol keeps:
- keep-alive and pipelining: requests are answered in order, one handler at a time per
  connection; reading pauses while too many wait;
- flow control: a write to a client that reads slowly waits (`Reply.write`) until the
  transport's buffer drains (`pause_writing` / `resume_writing`);
- disconnects: a client that closes its connection (or half-closes it) cancels the handler of
  its request, which is how the proxy aborts the upstream request and logs `disconnect`;
- bounds: a request head over 64 KiB is refused (431), a body over 64 MiB too (413, at once
  when its Content-Length says so, before any 100-continue), and a connection idle (or stuck in
  a request's head or body) for `KEEPALIVE_S` is closed by a sweep, not a timer per request;
- hostile framing is refused before anything reaches a handler
  (tests/integration/test_gateway_hostile.py): llhttp refuses Content-Length with
  Transfer-Encoding, repeated or malformed Content-Lengths, bad chunk sizes and CR, LF or NUL in
  a header; here a Transfer-Encoding other than exactly
  `chunked` is 501, one in an HTTP/1.0 request 400, an Upgrade or CONNECT 400, and trailer
  fields never join the headers (a trailer cannot set the X-Request-Id sent upstream);
- a stream's status line and headers leave with its first body bytes, in one write.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, cast

import httptools

log = logging.getLogger("servescope.gateway.http")

MAX_BODY = 64 * 2**20  # request bodies above this are answered 413
MAX_HEAD = 64 * 2**10  # request line + headers above this are answered 431
KEEPALIVE_S = 75.0  # idle connections are closed after this (aiohttp's default)
SWEEP_S = 5.0  # how often idle connections are looked for
MAX_PIPELINED = 16  # requests waiting on one connection before reading pauses
_REASONS = {s.value: s.phrase for s in HTTPStatus}


@dataclass(slots=True)
class Request:
    """One parsed request; header names lower-cased (the last of repeated headers wins)."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool
    http11: bool = True  # HTTP/1.0 clients get streams unchunked, ended by closing


@dataclass(slots=True)
class Response:
    """A whole answer: written as one status line, headers and body."""

    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


def json_response(doc: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        status, json.dumps(doc).encode(), {"Content-Type": "application/json", **(headers or {})}
    )


Handler = Callable[[Request, "Reply"], Awaitable["Response | Reply"]]


def _head(status: int, headers: dict[str, str], framing: str) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value:  # never let a value (a client's request id) split
            value = value.replace("\r", " ").replace("\n", " ")
        lines.append(f"{name}: {value}\r\n")
    lines.append(framing)
    return "".join(lines).encode("latin-1", errors="replace")


class Reply:
    """The streamed answer to one request: `start` names status and headers, which leave with
    the first `write` (chunked transfer-encoding); `write_eof` ends the body. Writes raise
    `ConnectionResetError` once the client is gone."""

    __slots__ = ("_conn", "_head", "chunked", "prepared", "finished")

    def __init__(self, conn: _Connection, chunked: bool = True) -> None:
        self._conn = conn
        self._head = b""
        self.chunked = chunked
        self.prepared = False  # status and headers sent
        self.finished = False  # body ended

    def start(self, status: int, headers: dict[str, str]) -> None:
        framing = (
            "Transfer-Encoding: chunked\r\n\r\n" if self.chunked else "Connection: close\r\n\r\n"
        )
        self._head = _head(status, headers, framing)

    async def write(self, data: bytes) -> None:
        if data:
            await self._send(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)

    async def write_eof(self, data: bytes = b"") -> None:
        if self.finished:
            return
        self.finished = True
        if not self.chunked:
            await self._send(data)
        elif data:
            await self._send(b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data))
        else:
            await self._send(b"0\r\n\r\n")

    async def _send(self, frame: bytes) -> None:
        conn = self._conn
        if conn.transport is None or conn.closed:
            raise ConnectionResetError("the client closed the connection")
        if not self.prepared:
            self.prepared = True
            frame = self._head + frame
        conn.transport.write(frame)
        if conn.write_paused:
            await conn.drain()


class _Connection(asyncio.Protocol):
    """One client connection: parse, queue, answer in order."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.closed = False
        self.write_paused = False
        self._drain: asyncio.Future[None] | None = None
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._size = 0
        self._head_size = 0
        self._in_head = False  # header callbacks after the head are trailer fields: dropped
        self._waiting: deque[Request] = deque()
        self._task: asyncio.Task[None] | None = None
        self._read_paused = False
        self.idle_since: float | None = None  # loop time; None while a request is answered

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream connection's transport: asyncio's is a Transport, uvloop's has the same methods
        # without subclassing it, so it is declared rather than checked
        self.transport = cast(asyncio.Transport, transport)
        self.idle_since = asyncio.get_running_loop().time()
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400)
        except httptools.HttpParserError as exc:  # httptools wraps what its callbacks raise
            cause = exc.__cause__ or exc.__context__
            self._refuse(cause.status if isinstance(cause, _Refused) else 400)
        except _Refused as exc:
            self._refuse(exc.status)

    def eof_received(self) -> bool:
        return False  # a half-close is a client gone: close, which cancels its handler

    def connection_lost(self, _exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self._waiting.clear()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._wake(ConnectionResetError("the client closed the connection"))

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake(None)

    async def drain(self) -> None:
        """Wait until the transport's buffer is below its low-water mark again."""
        if self.closed:
            raise ConnectionResetError("the client closed the connection")
        if not self.write_paused:
            return
        if self._drain is None or self._drain.done():
            self._drain = asyncio.get_running_loop().create_future()
        await self._drain

    def _wake(self, exc: Exception | None) -> None:
        waiter, self._drain = self._drain, None
        if waiter is not None and not waiter.done():
            if exc is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(exc)
                waiter.exception()  # retrieved: nobody may be waiting any more

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = {}
        self._body = []
        self._size = 0
        self._head_size = 0
        self._in_head = True

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_size += len(url)
        if self._head_size > MAX_HEAD:
            raise _Refused(431)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value)
        if self._head_size > MAX_HEAD:
            raise _Refused(431)
        if self._in_head:
            self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self._in_head = False
        headers = self._headers
        coding = headers.get("transfer-encoding")
        if coding is not None:
            if self.parser.get_http_version() == "1.0":  # RFC 9112 6.1: faulty framing
                raise _Refused(400)
            if coding.strip().lower() != "chunked":  # the only coding a request may have here
                raise _Refused(501)
        if "upgrade" in headers or self.parser.get_method() == b"CONNECT":
            raise _Refused(400)  # HTTP/1.1 only: never a tunnel, never another protocol
        length = headers.get("content-length", "0")
        if length.isdigit() and int(length) > MAX_BODY:
            raise _Refused(413)
        if (
            self._headers.get("expect", "").lower() == "100-continue"
            and self._task is None  # never inside another request's answer (pipelining)
            and self.transport is not None
        ):
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > MAX_BODY:
            raise _Refused(413)
        self._body.append(body)

    def on_message_complete(self) -> None:
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request = Request(
            method=self.parser.get_method().decode("latin-1"),
            path=self._url.split(b"?", 1)[0].decode("latin-1"),
            headers=self._headers,
            body=body,
            keep_alive=self.parser.should_keep_alive(),
            http11=self.parser.get_http_version() != "1.0",
        )
        self._waiting.append(request)
        if self._task is None:
            self._next()
        elif len(self._waiting) >= MAX_PIPELINED and self.transport and not self._read_paused:
            self._read_paused = True
            self.transport.pause_reading()

    # answering
    def _next(self) -> None:
        request = self._waiting.popleft()
        self.idle_since = None
        self._task = asyncio.get_running_loop().create_task(self._answer(request))

    async def _answer(self, request: Request) -> None:
        reply = Reply(self, chunked=request.http11)
        try:
            answer = await self.server.dispatch(request, reply)
        except asyncio.CancelledError:  # the client is gone
            return
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            answer = json_response({"error": {"message": "internal error"}}, 500)
        if self.closed or self.transport is None:
            return
        if isinstance(answer, Response):
            if reply.prepared:  # a stream already started cannot become a whole answer
                self.transport.close()
                return
            self._write_whole(request, answer)
            if self.write_paused:  # a client pipelining without reading: answer no more yet
                try:
                    await self.drain()
                except (ConnectionError, asyncio.CancelledError):
                    return
        elif not reply.finished or not reply.chunked:  # ended by closing, or broken: never reused
            self.transport.close()
            return
        self._task = None
        if not request.keep_alive:
            self.transport.close()
        elif self._waiting:
            self._next()
            return
        elif self._read_paused:
            self._read_paused = False
            self.transport.resume_reading()
        self.idle_since = asyncio.get_running_loop().time()

    def _write_whole(self, request: Request, answer: Response) -> None:
        assert self.transport is not None
        head = _head(answer.status, answer.headers, f"Content-Length: {len(answer.body)}\r\n\r\n")
        self.transport.write(head if request.method == "HEAD" else head + answer.body)

    def _refuse(self, status: int) -> None:
        """A request that cannot be parsed or is too big: answer and close (just close while an
        earlier request is being answered: the answer would land inside that one's)."""
        if self.transport is not None and self._task is not None:
            self.transport.close()
        elif self.transport is not None and not self.closed:
            body = json.dumps({"error": {"message": _REASONS[status], "code": status}}).encode()
            self.transport.write(
                _head(status, {"Content-Type": "application/json", "Connection": "close"},
                      f"Content-Length: {len(body)}\r\n\r\n") + body
            )  # fmt: skip
            self.transport.close()


class _Refused(Exception):
    """Raised inside the parser's callbacks: the request is refused with `status` (a head or
    body over its limit, framing the gateway does not take)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class Server:
    """Routes by exact (method, path); `serve` listens; `shutdown` ends gracefully."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], Handler] = {}
        self.connections: set[_Connection] = set()
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    def add(self, method: str, path: str, handler: Handler) -> None:
        self.routes[(method, path)] = handler
        if method == "GET":
            self.routes[("HEAD", path)] = handler

    async def dispatch(self, request: Request, reply: Reply) -> Response | Reply:
        handler = self.routes.get((request.method, request.path))
        if handler is not None:
            return await handler(request, reply)
        if any(path == request.path for _method, path in self.routes):
            return json_response({"error": {"message": "method not allowed"}}, 405)
        return json_response({"error": {"message": f"no route {request.path}"}}, 404)

    async def serve(self, host: str, port: int, backlog: int = 4096) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), host, port, backlog=backlog
        )
        self._sweeper = loop.call_later(SWEEP_S, self._sweep)

    def _sweep(self) -> None:
        """Close the connections idle for `KEEPALIVE_S` (one timer for all of them)."""
        loop = asyncio.get_running_loop()
        limit = loop.time() - KEEPALIVE_S
        for conn in list(self.connections):
            if conn.idle_since is not None and conn.idle_since < limit and conn.transport:
                conn.transport.close()
        self._sweeper = loop.call_later(SWEEP_S, self._sweep)

    async def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stop listening, let requests in flight finish for up to `timeout_s` (aiohttp's
        default, which the gateway had), then close: the handlers left are cancelled, so their
        upstream requests are aborted and their events say `disconnect`."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        tasks = [c._task for c in self.connections if c._task is not None and not c._task.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        left = [task for task in tasks if not task.done()]
        for task in left:  # cancelled here, not when their connections report the close
            task.cancel()
        if left:  # their handlers write their events before the event log is closed
            await asyncio.wait(left, timeout=5.0)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        if self._server is not None:
            await self._server.wait_closed()
