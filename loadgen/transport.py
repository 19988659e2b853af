"""A minimal HTTP/1.1 keep-alive transport for the benchmark's hot path, timed by the kernel.

A benchmark client must not be the bottleneck it measures, nor put its own waits into what it
measures. aiohttp spends most of a streamed completion's client time in its own layers; this
transport writes a pre-built request on a plain non-blocking socket, has the event loop's
selector call it when the socket is readable (`loop.add_reader`), reads with `recvmsg`, and
parses with `httptools` (C). Plain `http://` on a Unix event loop only — what a benchmark
against a local server needs; anything else goes through aiohttp.

What the times mean. Every time is on CLOCK_REALTIME (`time.time_ns()`, the kernel's receive
timestamps' clock), in seconds since this module was imported (`wire_now`):
- sent: the clock read just before the request is handed to the kernel (`send`).
- arrival: on Linux the socket has `SO_TIMESTAMPNS`, so each `recvmsg` returns the kernel's
  receive timestamp, taken when the packet entered the host's receive path, of the last segment
  that read consumed. TCP merges segments that queue up unread into one that keeps the newest
  timestamp, so a read's stamp is the arrival of the newest bytes read with it: every byte of
  the read had arrived by its stamp, none is stamped earlier than it arrived. What the stamp
  leaves out is the wait between arrival and the moment the event loop comes round to read —
  the client's own overhead, which a saturated single-process client (a closed loop of 64
  against an instant server) used to count into TTFT. TTFT and e2e are thus the server as seen
  on the wire: request handed to the kernel → response bytes received by the kernel.
- All SSE messages of one read carry its stamp. Messages that queued up unread share the
  newest one's stamp (their ITL gaps read 0 and the gap before them holds the whole wait), as
  with a clock read at read time — but only when they really queued in the kernel, not because
  the loop was busy. Reads are up to `READ_SIZE` bytes; smaller reads would not help, since
  merged segments keep one stamp.
- Where the kernel gives no stamp (another OS, or a segment that arrived before timestamps
  were on), the arrival is the clock read when the data is read: the loop's view, as before.
A clock step (not NTP's slewing) during a request would distort that request's times.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any, Protocol, cast
from urllib.parse import urlsplit

import httptools

from servescope.loadgen.request import ClientEvent, RequestBody
from servescope.store.clock import utc_now_iso
from servescope.wire.stream import (
    ROUTE_HEADER_PREFIX,
    ROUTE_HEADERS,
    Endpoint,
    StreamTiming,
    mark_failed,
)

READ_SIZE = 65536


@dataclass(frozen=True)
class StreamCall:
    """One streaming request as `loadgen.client.stream_request` takes it, passed whole to
    whichever transport carries it."""

    endpoint: Endpoint
    payload: RequestBody
    request_id: str
    headers: dict[str, str] | None = None
    timeout_s: float | None = None
    keep_text: bool = False  # return the generated text as `output_text`

    def body(self) -> dict[str, object]:
        """The payload as sent: streamed, with the usage in the last message."""
        return {**self.payload, "stream": True, "stream_options": {"include_usage": True}}

    def send_headers(self) -> dict[str, str]:
        """The request id as `X-Request-Id` (vLLM keeps it in its ids), then the caller's."""
        return {"X-Request-Id": self.request_id, **(self.headers or {})}

    def event(self) -> dict[str, Any]:
        """The request's event as it starts: its id and send time."""
        return {"request_id": self.request_id, "ts": utc_now_iso()}


# Linux's SO_TIMESTAMPNS (= its SCM_TIMESTAMPNS cmsg type), the generic value (x86, arm, riscv,
# powerpc, s390); Python's socket module does not name it.
SO_TIMESTAMPNS: int | None = getattr(
    socket, "SO_TIMESTAMPNS", 35 if sys.platform == "linux" else None
)
_TIMESPEC = struct.Struct("@ll")  # struct timespec {time_t tv_sec; long tv_nsec}
ANCILLARY_SIZE = socket.CMSG_SPACE(_TIMESPEC.size) if SO_TIMESTAMPNS is not None else 0
_EPOCH_NS = time.time_ns()


def wire_now() -> float:
    """CLOCK_REALTIME as seconds since import: the clock of the kernel's receive stamps."""
    return (time.time_ns() - _EPOCH_NS) * 1e-9


def arrival_of(ancillary: list[tuple[int, int, bytes]]) -> float:
    """A read's arrival time: the kernel's receive stamp when the read carries one, else now."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) == _TIMESPEC.size:
            sec, nsec = _TIMESPEC.unpack(data)
            return (sec * 1_000_000_000 + nsec - _EPOCH_NS) * 1e-9
    return wire_now()


class ConnectFailed(ConnectionError):
    """No connection could be made: the `connect` error class (anything later: `disconnect`)."""


class StaleConnection(ConnectionError):
    """A kept-alive connection the server had closed before this request: retried, not failed."""


class Listener(Protocol):
    """What one exchange reports, as it happens (times as in the module docstring)."""

    def sent(self, at: float) -> None: ...
    def head(self, status: int) -> None: ...
    def header(self, name: str, value: str) -> None: ...
    def data(self, data: bytes, at: float) -> None: ...
    def ended(self, at: float) -> None: ...


class Connection:
    """One keep-alive connection, one request at a time. The selector watches the socket for
    its whole life, so a server closing an idle connection is noticed before it is reused."""

    __slots__ = ("sock", "loop", "parser", "closed", "reused", "_listener", "_done", "_arrival",
                 "_got", "_head")  # fmt: skip

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        self.sock = sock
        self.loop = loop
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.reused = False
        self._listener: Listener | None = None
        self._done: asyncio.Future[bool] | None = None
        self._arrival = 0.0
        self._got = False  # any byte of the current response
        self._head = False  # its head parsed
        loop.add_reader(sock.fileno(), self._readable)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()

    async def exchange(self, payload: bytes, listener: Listener) -> bool:
        """Send one request and feed its response to `listener`; returns whether the connection
        may be kept alive. A reused connection that turns out closed raises `StaleConnection`."""
        self._listener, self._got, self._head = listener, False, False
        done = self._done = self.loop.create_future()
        try:
            listener.sent(wire_now())
            try:
                sent = self.sock.send(payload)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                if self.reused:
                    raise StaleConnection(repr(exc)) from exc
                raise
            if sent < len(payload):
                await self.loop.sock_sendall(self.sock, memoryview(payload)[sent:])
            return await done
        finally:
            self._done = self._listener = None

    # the selector's callback
    def _readable(self) -> None:
        try:
            data, ancillary, _, _ = self.sock.recvmsg(READ_SIZE, ANCILLARY_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._lost(exc)
            return
        if not data:
            self._lost(None)
            return
        if self._done is None or self._done.done():  # bytes nobody asked for: drop the connection
            self.close()
            return
        self._arrival = arrival_of(ancillary)
        self._got = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:  # raised by the listener
            self._fail(exc.__context__ if isinstance(exc.__context__, Exception) else exc)
        except httptools.HttpParserError as exc:
            self._fail(ValueError(f"unparseable response: {exc}"))

    def _lost(self, exc: OSError | None) -> None:
        self.close()
        done, listener = self._done, self._listener
        if done is None or done.done() or listener is None:
            return
        if not self._got and self.reused:
            done.set_exception(StaleConnection(f"kept-alive connection closed: {exc!r}"))
        elif self._head and exc is None:  # a body without length ends with the connection
            listener.ended(wire_now())
            done.set_result(False)
        else:
            done.set_exception(ConnectionResetError(f"connection lost mid-response: {exc!r}"))

    def _fail(self, exc: Exception) -> None:
        self.close()
        if self._done is not None and not self._done.done():
            self._done.set_exception(exc)

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if name[:13].lower() == ROUTE_HEADER_PREFIX and self._listener is not None:
            self._listener.header(name.decode("latin-1").lower(), value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        self._head = True
        if self._listener is not None:
            self._listener.head(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        if self._listener is not None:
            self._listener.data(body, self._arrival)

    def on_message_complete(self) -> None:
        if self._done is not None and not self._done.done() and self._listener is not None:
            self._listener.ended(self._arrival)
            self._done.set_result(self.parser.should_keep_alive())


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

    async def acquire(self) -> Connection:
        """An idle connection (marked `reused`: it may turn out stale), or a new one."""
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                conn.reused = True
                return conn
        return await self._connect()

    async def _connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            addresses = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise ConnectFailed(repr(exc)) from exc
        error: OSError | None = None
        for family, kind, proto, _, address in addresses:
            sock = socket.socket(family, kind, proto)
            try:
                sock.setblocking(False)
                await loop.sock_connect(sock, address)
            except OSError as exc:
                sock.close()
                error = exc
                continue
            except BaseException:
                sock.close()
                raise
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if SO_TIMESTAMPNS is not None:
                with contextlib.suppress(OSError):  # else arrivals are read times (see above)
                    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            return Connection(sock, loop)
        raise ConnectFailed(repr(error))

    def release(self, conn: Connection) -> None:
        self._idle.append(conn)

    def close(self) -> None:
        while self._idle:
            self._idle.pop().close()

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


async def post(
    pool: Http1Pool, path: str, body: bytes, headers: dict[str, str], listener: Listener
) -> None:
    """POST and stream the answer to `listener`; a stale kept-alive connection is retried once
    on a fresh one. Connection errors propagate to the caller, who classifies them."""
    payload = pool.request_bytes(path, body, headers)
    for _ in range(2):
        conn = await pool.acquire()
        keep = False
        try:
            keep = await conn.exchange(payload, listener)
            return
        except StaleConnection:
            continue
        finally:
            if keep:
                pool.release(conn)
            else:
                conn.close()
    raise ConnectionResetError("the server closed two connections in a row before answering")


class _Stream:
    """One streamed completion's listener: SSE lines into `StreamTiming`, stamped by arrival."""

    __slots__ = ("event", "endpoint", "timing", "keep_text", "pieces", "refused", "rest",
                 "status", "error", "end")  # fmt: skip

    def __init__(self, event: dict[str, Any], endpoint: Endpoint, keep_text: bool) -> None:
        self.event = event
        self.endpoint = endpoint
        self.timing = StreamTiming(endpoint, wire_now())  # until sent: failures before sending
        self.keep_text = keep_text
        self.pieces: list[str] = []
        self.refused: list[bytes] = []
        self.rest = b""
        self.status = 0
        self.error: str | None = None
        self.end = 0.0

    def sent(self, at: float) -> None:
        self.timing.start = at

    def head(self, status: int) -> None:
        self.status = self.event["http_status"] = status

    def header(self, name: str, value: str) -> None:
        if (key := ROUTE_HEADERS.get(name)) is not None:
            self.event[key] = value

    def ended(self, at: float) -> None:
        self.end = at

    def data(self, data: bytes, at: float) -> None:
        if self.status != 200:
            self.refused.append(data)
            return
        timing = self.timing
        if timing.done or self.error is not None:
            return  # the rest of the body is read only so the connection can be reused
        *lines, self.rest = (self.rest + data).split(b"\n")
        for raw in lines:
            if len(raw) < 5:  # the blank lines between SSE messages
                continue
            chunk = timing.feed_line(raw, at)
            if timing.done:
                return
            if chunk is None:
                continue
            if "error" in chunk:
                self.error = json.dumps(chunk["error"])
                return
            if self.keep_text:
                self.pieces.extend(self.endpoint.text_of(c) for c in chunk.get("choices") or ())


async def stream_request_http1(pool: Http1Pool, call: StreamCall) -> ClientEvent:
    """`loadgen.client.stream_request` over this transport (what `bench run` uses against
    `http://` targets): the same timing rules (`StreamTiming`), the same event, with the times
    of the module docstring."""
    # wire.stream's rules fill the event, under ClientEvent's keys
    return cast(ClientEvent, await _exchange(pool, call))


async def _exchange(pool: Http1Pool, call: StreamCall) -> dict[str, Any]:
    body = json.dumps(call.body()).encode()
    event = call.event()
    stream = _Stream(event, call.endpoint, call.keep_text)
    timing = stream.timing
    try:
        async with asyncio.timeout(call.timeout_s):
            await post(pool, call.endpoint.path, body, call.send_headers(), stream)
    except TimeoutError as exc:
        return mark_failed(event, timing.start, "timeout", "timeout", repr(exc), wire_now)
    except ConnectFailed as exc:
        return mark_failed(event, timing.start, "connect", "error", str(exc), wire_now)
    except (OSError, EOFError, ValueError) as exc:
        return mark_failed(event, timing.start, "disconnect", "error", repr(exc), wire_now)
    status = stream.status
    if status != 200:
        kind = "http_5xx" if status >= 500 else "http_4xx"
        detail = b"".join(stream.refused)[:500].decode("utf-8", "replace")
        return mark_failed(event, timing.start, kind, "error", detail, wire_now)
    if stream.error is not None:
        return mark_failed(event, timing.start, "http_5xx", "error", stream.error, wire_now)
    if not timing.done:
        return mark_failed(
            event, timing.start, "disconnect", "error", "stream ended before [DONE]", wire_now
        )
    if call.keep_text:
        event["output_text"] = "".join(stream.pieces)
    return timing.finish(event, stream.end)
