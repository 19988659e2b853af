"""The gateway's lean HTTP/1.1 server (`gateway.httpserver`) on its own, over real sockets: streams
that outgrow the socket buffers reach a slow reader whole (flow control), pipelined requests are
answered in order, a client that leaves cancels its handler, bad input is refused."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import uvloop

from servescope.gateway import httpserver
from servescope.gateway.httpserver import Handler, Reply, Request, Response, Server, json_response

Runner = Callable[[Callable[[], Awaitable[None]]], None]
BIG_CHUNK = b"x" * 65_536
BIG_CHUNKS = 160  # 10 MiB: far past the transport's high-water mark and the socket buffers


@asynccontextmanager
async def serving(server: Server) -> AsyncIterator[int]:
    """`server` on a free port (yielded), shut down afterwards."""
    await server.serve("127.0.0.1", 0)
    assert server._server is not None
    port = server._server.sockets[0].getsockname()[1]
    try:
        yield port
    finally:
        await server.shutdown(timeout_s=1)


def routed(*routes: tuple[str, str, Handler]) -> Server:
    """A server answering `routes`: (method, path, handler)."""
    server = Server()
    for method, path, handler in routes:
        server.add(method, path, handler)
    return server


async def read_response(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """Status line + headers, and the body (Content-Length or chunked)."""
    head = await reader.readuntil(b"\r\n\r\n")
    headers = {
        k.strip().lower(): v.strip()
        for k, _, v in (line.partition(b":") for line in head.split(b"\r\n")[1:] if line)
    }
    if b"content-length" in headers:
        return head, await reader.readexactly(int(headers[b"content-length"]))
    parts = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            return head, b"".join(parts)
        parts.append(data[:-2])


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Runner:
    """Each test on both loops: the gateway runs on uvloop when it is installed."""
    factory = uvloop.new_event_loop if request.param == "uvloop" else None

    def go(coro: Callable[[], Awaitable[None]]) -> None:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(asyncio.wait_for(coro(), 30))

    return go


def test_a_big_stream_reaches_a_slow_reader_whole(
    run: Runner,
) -> None:
    async def stream(_request: Request, reply: Reply) -> Reply:
        reply.start(200, {"Content-Type": "text/event-stream"})
        for _ in range(BIG_CHUNKS - 1):
            await reply.write(BIG_CHUNK)
        await reply.write_eof(BIG_CHUNK)
        return reply

    async def main() -> None:
        async with serving(routed(("GET", "/big", stream))) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=2**20)
            writer.write(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n" * 2)  # a second one kept alive
            await asyncio.sleep(0.3)  # the server fills every buffer and must wait
            for _ in range(2):
                head, body = await read_response(reader)
                assert head.startswith(b"HTTP/1.1 200 OK\r\n")
                assert len(body) == BIG_CHUNKS * len(BIG_CHUNK)
                assert (
                    hashlib.sha256(body).digest() == hashlib.sha256(BIG_CHUNK * BIG_CHUNKS).digest()
                )
            writer.close()

    run(main)


def test_pipelined_requests_are_answered_in_order(
    run: Runner,
) -> None:
    async def echo(request: Request, _reply: Reply) -> Response:
        await asyncio.sleep(0.01 if request.body == b"first" else 0)
        return Response(200, request.body, {"Content-Type": "text/plain"})

    async def main() -> None:
        async with serving(routed(("POST", "/echo", echo))) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"".join(
                    b"POST /echo HTTP/1.1\r\nContent-Length: %d\r\n\r\n%b" % (len(b), b)
                    for b in (b"first", b"second", b"third")
                )
            )
            bodies = [(await read_response(reader))[1] for _ in range(3)]
            assert bodies == [b"first", b"second", b"third"]
            writer.close()

    run(main)


def test_a_client_that_leaves_cancels_its_handler(
    run: Runner,
) -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def wait_forever(_request: Request, _reply: Reply) -> Response:
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return json_response({})

    async def main() -> None:
        async with serving(routed(("GET", "/wait", wait_forever))) as port:
            _reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.wait_for(started.wait(), 10)  # in its handler before the client goes
            writer.close()
            await asyncio.wait_for(cancelled.wait(), 10)

    run(main)


async def ok(_request: Request, _reply: Reply) -> Response:
    return json_response({"ok": True})


def test_bad_requests_and_unknown_routes_are_refused(
    run: Runner,
) -> None:
    async def main() -> None:
        async with serving(routed(("GET", "/ok", ok))) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            for request, status in [
                (b"GET /nope HTTP/1.1\r\n\r\n", b"404"),
                (b"POST /ok HTTP/1.1\r\nContent-Length: 0\r\n\r\n", b"405"),
                (b"GET /ok?x=1 HTTP/1.1\r\n\r\n", b"200"),
            ]:
                writer.write(request)
                head, _body = await read_response(reader)
                assert head.split(b" ")[1] == status, head
            writer.write(b"NOT HTTP AT ALL\r\n\r\n")
            head, _body = await read_response(reader)
            assert head.split(b" ")[1] == b"400"
            assert await reader.read() == b""  # and the connection is closed
            writer.close()

    run(main)


def test_http10_streams_unchunked_and_closes(run: Runner) -> None:
    async def stream(_request: Request, reply: Reply) -> Reply:
        reply.start(200, {"Content-Type": "text/event-stream"})
        await reply.write(b"data: 1\n\n")
        await reply.write_eof(b"data: [DONE]\n\n")
        return reply

    async def main() -> None:
        async with serving(routed(("GET", "/s", stream))) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /s HTTP/1.0\r\n\r\n")
            answer = await reader.read()  # up to the close that ends the body
            head, _, body = answer.partition(b"\r\n\r\n")
            assert b"chunked" not in head.lower()
            assert body == b"data: 1\n\ndata: [DONE]\n\n"
            writer.close()

    run(main)


def test_oversized_heads_and_idle_connections_are_closed(
    run: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(httpserver, "KEEPALIVE_S", 0.2)
    monkeypatch.setattr(httpserver, "SWEEP_S", 0.1)
    monkeypatch.setattr(httpserver, "MAX_BODY", 1000)

    async def main() -> None:
        async with serving(routed(("GET", "/ok", ok))) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /ok HTTP/1.1\r\n" + b"X-Big: " + b"y" * 70_000 + b"\r\n\r\n")
            head, _body = await read_response(reader)
            assert head.split(b" ")[1] == b"431"
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /ok HTTP/1.1\r\nContent-Length: 2000\r\n\r\n" + b"z" * 2000)
            head, _body = await read_response(reader)
            assert head.split(b" ")[1] == b"413"
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /ok HTTP/1.1\r\n\r\n")
            head, _body = await read_response(reader)
            assert head.split(b" ")[1] == b"200"
            writer.write(b"GET /ok HTTP/1.1\r\n")  # a head never finished
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the sweep
            writer.close()

    run(main)


def test_a_client_pipelining_without_reading_is_not_buffered_for(run: Runner) -> None:
    body = b"m" * 2**20

    async def metrics(_request: Request, _reply: Reply) -> Response:
        return Response(200, body, {"Content-Type": "text/plain"})

    async def main() -> None:
        server = routed(("GET", "/metrics", metrics))
        async with serving(server) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=2**22)
            writer.write(b"GET /metrics HTTP/1.1\r\n\r\n" * 50)
            await asyncio.sleep(0.5)
            (conn,) = server.connections
            assert conn.transport is not None
            assert conn.transport.get_write_buffer_size() <= 2 * len(body)  # not 50 of them
            for _ in range(50):
                assert (await read_response(reader))[1] == body
            writer.close()

    run(main)


def test_shutdown_waits_then_cancels_what_is_left_before_returning(run: Runner) -> None:
    finished: list[str] = []

    async def main() -> None:
        started = {b"/quick": asyncio.Event(), b"/slow": asyncio.Event()}
        release = asyncio.Event()

        async def quick(_request: Request, _reply: Reply) -> Response:
            started[b"/quick"].set()
            await release.wait()  # set once shutdown is under way: it finishes while waited on
            finished.append("quick")
            return json_response({})

        async def slow(_request: Request, _reply: Reply) -> Response:
            started[b"/slow"].set()
            try:
                await asyncio.sleep(3600)
            finally:
                finished.append("slow cancelled")  # the gateway writes its event here
            return json_response({})

        server = routed(("GET", "/quick", quick), ("GET", "/slow", slow))
        await server.serve("127.0.0.1", 0)
        assert server._server is not None
        port = server._server.sockets[0].getsockname()[1]
        clients = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        for (_reader, writer), path in zip(clients, (b"/quick", b"/slow"), strict=True):
            writer.write(b"GET %b HTTP/1.1\r\n\r\n" % path)
        for event in started.values():  # both requests in their handlers
            await asyncio.wait_for(event.wait(), 10)
        # timeout_s: the slow one's wait; the quick one needs a few turns of the loop of it
        stopping = asyncio.create_task(server.shutdown(timeout_s=5.0))
        while server._server.is_serving():  # shutdown has begun
            await asyncio.sleep(0)
        release.set()
        await stopping
        assert finished == ["quick", "slow cancelled"]
        head, _body = await read_response(clients[0][0])
        assert head.startswith(b"HTTP/1.1 200")
        for _reader, writer in clients:
            writer.close()

    run(main)
