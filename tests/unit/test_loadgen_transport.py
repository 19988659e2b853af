"""loadgen.transport against a real local server on a real TCP socket: arrivals are the kernel's
receive stamps, not the moment a busy event loop gets round to reading."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from servescope.loadgen import transport
from servescope.loadgen.client import stream_request
from servescope.loadgen.transport import Http1Pool
from servescope.wire.stream import COMPLETIONS

WAIT_S = 30.0  # a deadline for each handshake between the server, the loop and the test
HOLD_S = 0.2  # the loop stays blocked this long after the rest is sent: read times come later
EPS_S = 1e-6  # float rounding of the wire clock's seconds, nothing more
LAG_S = HOLD_S / 4  # how late a deferred kernel delivery may stamp a segment after its send


def sse(data: str) -> bytes:
    message = f"data: {data}\n\n".encode()
    return f"{len(message):x}\r\n".encode() + message + b"\r\n"


FIRST = sse(json.dumps({"choices": [{"index": 0, "text": " a", "finish_reason": None}]}))
REST = (
    sse(json.dumps({"choices": [{"index": 0, "text": " b", "finish_reason": "length"}]}))
    + sse(json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}))
    + sse("[DONE]")
    + b"0\r\n\r\n"
)
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def wire(ns: int) -> float:
    """A `time.time_ns()` reading on the transport's clock (seconds since its import)."""
    return (ns - transport._EPOCH_NS) * 1e-9


class SlowServer:
    """Answers the first request whole. Answers the next with the head and the first token,
    then the rest once the client's loop is blocked (`blocked`), then sets `rest_sent`; each
    `sendall` is bracketed by the clock (`first_ns`, `rest_ns`: before, after), so the kernel's
    receive stamps of what it sends fall inside those windows."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.blocked = threading.Event()
        self.rest_sent = threading.Event()
        self.first_ns = (0, 0)
        self.rest_ns = (0, 0)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        # No Nagle: a small send must not wait for the client's (delayed) ACK of the one before.
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            buffer = b""
            warm = True
            while True:
                while b"\r\n\r\n" not in buffer:
                    if not (data := conn.recv(65536)):
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                while len(buffer) < length:
                    buffer += conn.recv(65536)
                buffer = buffer[length:]
                if warm:
                    conn.sendall(HEAD + FIRST + REST)
                    warm = False
                    continue
                before = time.time_ns()
                conn.sendall(HEAD + FIRST)
                self.first_ns = (before, time.time_ns())
                if not self.blocked.wait(WAIT_S):
                    return  # the client never blocked its loop: the test fails on its own
                before = time.time_ns()
                conn.sendall(REST)
                self.rest_ns = (before, time.time_ns())
                self.rest_sent.set()

    def close(self) -> None:
        self.listener.close()


class Recorded(transport._Stream):
    """The transport's listener, noting the send time and each read's (stamp, read time)."""

    made: ClassVar[list[Recorded]] = []  # this test's streams, in order

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.sent_at = 0.0
        self.reads: list[tuple[float, float, bytes]] = []
        Recorded.made.append(self)

    def sent(self, at: float) -> None:
        self.sent_at = at
        super().sent(at)

    def data(self, data: bytes, at: float) -> None:
        self.reads.append((at, transport.wire_now(), data))
        super().data(data, at)


@pytest.fixture
def server() -> Iterator[SlowServer]:
    server = SlowServer()
    yield server
    server.close()


async def _exchange(server: SlowServer) -> tuple[dict, Recorded, int]:
    """Warm a connection, then stream one request; once the loop has read its first token, the
    loop is blocked until the server has sent the rest and `HOLD_S` more, so the rest waits in
    the kernel. Returns the event, its listener and the clock when the loop was free again."""
    pool = Http1Pool(server.url)
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    await stream_request(pool, server.url, COMPLETIONS, body, "warm-000001")
    Recorded.made.clear()
    freed_ns = 0

    async def block_the_loop() -> None:
        nonlocal freed_ns
        deadline = time.monotonic() + WAIT_S
        while not (Recorded.made and Recorded.made[0].reads):  # the first token, read
            assert time.monotonic() < deadline, "the first token never came"
            await asyncio.sleep(0.001)
        server.blocked.set()
        # The loop can read nothing now: the rest arrives and waits in the kernel.
        assert server.rest_sent.wait(WAIT_S), "the server never sent the rest"
        time.sleep(HOLD_S)
        freed_ns = time.time_ns()

    event, _ = await asyncio.gather(
        stream_request(pool, server.url, COMPLETIONS, body, "slow-000002"), block_the_loop()
    )
    pool.close()
    return event, Recorded.made[0], freed_ns


def test_arrivals_are_kernel_stamps_not_read_times(
    server: SlowServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(transport, "_Stream", Recorded)
    event, stream, freed_ns = asyncio.run(_exchange(server))
    assert event["status"] == "ok", event
    assert event["completion_tokens"] == 2
    assert len(event["itl_ms"]) == 1
    first = stream.sent_at + event["ttft_ms"] / 1000
    second = first + event["itl_ms"][0] / 1000
    end = stream.sent_at + event["e2e_ms"] / 1000
    # Each token's time is the kernel's stamp, taken once the server had begun to send it and
    # soon after: on loopback the stamp is usually taken inside the sender's `sendall`, but a
    # loaded machine may defer that delivery to ksoftirqd, past the call's return (36 µs seen on
    # a busy run). LAG_S allows that and still tells a stamp from a read time, which is HOLD_S late.
    assert wire(server.first_ns[0]) - EPS_S <= first <= wire(server.first_ns[1]) + LAG_S
    assert wire(server.rest_ns[0]) - EPS_S <= second <= wire(server.rest_ns[1]) + LAG_S
    assert wire(server.rest_ns[0]) - EPS_S <= end <= wire(server.rest_ns[1]) + LAG_S
    # The loop read the rest only once it was free, HOLD_S after the send: a read-time clock
    # would have put the second token and the end there, not at the send.
    rest_read = [read_at for _, read_at, data in stream.reads if b'" b"' in data]
    assert len(rest_read) == 1, stream.reads
    assert rest_read[0] >= wire(freed_ns) > wire(server.rest_ns[1]) + EPS_S
