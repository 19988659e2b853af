"""loadgen.transport against a real local server on a real TCP socket: arrivals are the kernel's
receive stamps, not the moment a busy event loop gets round to reading."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from servescope.loadgen.client import stream_request
from servescope.loadgen.transport import Http1Pool
from servescope.wire.stream import COMPLETIONS

GAP_S = 0.3  # between the first SSE message and the rest, on the server
BLOCK_S = 0.4  # how long the client's loop is kept busy, from half-way through the gap


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


class SlowServer:
    """Answers each request with the head and the first token at once (then sets `first_sent`),
    the rest `GAP_S` later (then notes the clock in `answered_ns`)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.first_sent = threading.Event()
        self.answered_ns = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            buffer = b""
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
                conn.sendall(HEAD + FIRST)
                self.first_sent.set()
                time.sleep(GAP_S)
                conn.sendall(REST)
                self.answered_ns = time.time_ns()

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def server() -> Iterator[SlowServer]:
    server = SlowServer()
    yield server
    server.close()


async def _exchange(server: SlowServer) -> tuple[dict, int, float]:
    """Warm a connection, then stream one request; once its first token is in, the loop is kept
    busy for `BLOCK_S` from half-way through the server's `GAP_S`, so the rest of the response
    waits in the kernel. Returns the event, the clock before the call, and the call's wall time."""
    pool = Http1Pool(server.url)
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    await stream_request(pool, server.url, COMPLETIONS, body, "warm-000001")

    async def block_the_loop() -> None:
        while not server.first_sent.is_set():
            await asyncio.sleep(0.001)
        await asyncio.sleep(GAP_S / 2)  # the loop reads the first token meanwhile
        time.sleep(BLOCK_S)  # the loop can read nothing: the rest arrives and waits in the kernel

    server.first_sent.clear()
    before_ns = time.time_ns()
    wall = time.perf_counter()
    event, _ = await asyncio.gather(
        stream_request(pool, server.url, COMPLETIONS, body, "slow-000002"), block_the_loop()
    )
    wall = time.perf_counter() - wall
    pool.close()
    return event, before_ns, wall


def test_arrivals_are_kernel_stamps_not_read_times(server: SlowServer) -> None:
    event, before_ns, wall = asyncio.run(_exchange(server))
    assert event["status"] == "ok", event
    assert event["completion_tokens"] == 2
    assert wall >= GAP_S / 2 + BLOCK_S  # the loop read the end long after it had come
    # The send happened after `before_ns`, so `before_ns + e2e` is at most the real end stamp,
    # which the kernel took while the server was sending, before it read its clock: a read-time
    # clock would put the end at least BLOCK_S - GAP_S / 2 later.
    assert before_ns + event["e2e_ms"] * 1e6 <= server.answered_ns
    # The first token was read at once (the loop was free) and the second one's stamp is its
    # arrival: one gap of about GAP_S, not GAP_S / 2 + BLOCK_S.
    assert event["ttft_ms"] < GAP_S * 1000 / 2
    assert len(event["itl_ms"]) == 1
    assert GAP_S * 1000 * 0.9 <= event["itl_ms"][0] < (GAP_S + BLOCK_S / 2) * 1000
