"""Hostile clients against the gateway's HTTP/1.1 server (issue 15), over real sockets.

A corpus of what servers like uvicorn and nginx are known to refuse — request smuggling shapes
(Content-Length with Transfer-Encoding, two Content-Lengths, obfuscated Transfer-Encoding), bad
chunk sizes, CR/LF/NUL in headers, trailers, upgrades — each must be answered with its 4xx (or
the connection closed) with nothing reaching a handler, while another client's requests on other
connections are answered as usual. Slowloris heads and bodies that never end are closed by the
sweep. Then the real gateway in front of a recording upstream (a stand-in: only it can show
every byte vLLM would have been sent): nothing hostile is forwarded. Last, the same corpus
against uvicorn with httptools (the same C parser) through a raw ASGI app: where the two differ
is asserted here and written down in docs/benchmarks.md ("Hostile clients")."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import uvicorn
import uvloop

from servescope.gateway import httpserver
from servescope.gateway.config import parse_config
from servescope.gateway.httpserver import Reply, Request, Response, Server, json_response
from servescope.gateway.server import Gateway, build_server

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from gateway_asgi import asgi_app  # noqa: E402

H = b"POST /echo HTTP/1.1\r\nHost: x\r\n"
CHUNKED = b"5\r\nhello\r\n0\r\n\r\n"
TE = H + b"Transfer-Encoding: chunked\r\n\r\n"  # a chunked head; its chunks follow
BAD = (400, None)
# name -> (raw request, (status or None for a close without an answer, body forwarded or None))
CORPUS: dict[str, tuple[bytes, tuple[int | None, bytes | None]]] = {
    "valid, Content-Length": (H + b"Content-Length: 5\r\n\r\nhello", (200, b"hello")),
    "valid, chunked": (H + b"Transfer-Encoding: chunked\r\n\r\n" + CHUNKED, (200, b"hello")),
    "valid, chunk extension": (
        H + b"Transfer-Encoding: chunked\r\n\r\n5;a=b\r\nhello\r\n0\r\n\r\n", (200, b"hello")),
    "valid, TE in capitals and a tab": (
        H + b"Transfer-Encoding:\tCHUNKED\r\n\r\n" + CHUNKED, (200, b"hello")),
    "CL.TE smuggling": (
        H + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
        b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n", (400, None)),
    "TE.CL smuggling": (
        H + b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n5c\r\nGPOST / HTTP/1.1\r\n"
        b"\r\n0\r\n\r\n", (400, None)),
    "two different Content-Lengths": (
        H + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello!", (400, None)),
    "the same Content-Length twice": (
        H + b"Content-Length: 5\r\nContent-Length: 5\r\n\r\nhello", (400, None)),
    "Content-Length list": (H + b"Content-Length: 5, 5\r\n\r\nhello", (400, None)),
    "negative Content-Length": (H + b"Content-Length: -5\r\n\r\nhello", (400, None)),
    "Content-Length with a sign": (H + b"Content-Length: +5\r\n\r\nhello", (400, None)),
    "hex Content-Length": (H + b"Content-Length: 0x5\r\n\r\nhello", (400, None)),
    "Content-Length past 2**64": (H + b"Content-Length: 99999999999999999999999\r\n\r\n", BAD),
    "TE: xchunked": (H + b"Transfer-Encoding: xchunked\r\n\r\n" + CHUNKED, (501, None)),
    "TE with a space before the colon": (
        H + b"Transfer-Encoding : chunked\r\n\r\n" + CHUNKED, (400, None)),
    "TE: chunked, identity": (
        H + b"Transfer-Encoding: chunked, identity\r\n\r\n" + CHUNKED, (400, None)),
    "TE: identity, chunked": (
        H + b"Transfer-Encoding: identity, chunked\r\n\r\n" + CHUNKED, (501, None)),
    "TE folded onto a second line": (
        H + b"Transfer-Encoding:\r\n chunked\r\n\r\n" + CHUNKED, (400, None)),
    "TE twice": (
        H + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n\r\n" + CHUNKED,
        (400, None)),
    "TE in an HTTP/1.0 request": (
        b"POST /echo HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n" + CHUNKED, (400, None)),
    "chunk size -1": (TE + b"-1\r\nhello\r\n0\r\n\r\n", BAD),
    "chunk size past 2**64": (
        H + b"Transfer-Encoding: chunked\r\n\r\nfffffffffffffffffffff\r\nhello\r\n0\r\n\r\n",
        (400, None)),
    "chunk size 0x5": (TE + b"0x5\r\nhello\r\n0\r\n\r\n", BAD),
    "chunk size with garbage": (
        H + b"Transfer-Encoding: chunked\r\n\r\n5 z\r\nhello\r\n0\r\n\r\n", (400, None)),
    "chunk longer than its size": (
        H + b"Transfer-Encoding: chunked\r\n\r\n3\r\nhello\r\n0\r\n\r\n", (400, None)),
    "chunks ended by bare LF": (TE + b"5\nhello\n0\n\n", BAD),
    "CR in a header value": (
        H + b"X-Request-Id: a\rGET /x\r\nContent-Length: 5\r\n\r\nhello", (400, None)),
    "LF in a header value": (
        H + b"X-Request-Id: a\nInjected: 1\r\nContent-Length: 5\r\n\r\nhello", (400, None)),
    "NUL in a header value": (H + b"X-Request-Id: a\x00b\r\nContent-Length: 5\r\n\r\nhello", BAD),
    "header folded onto a second line": (
        H + b"X-Request-Id: a\r\n b\r\nContent-Length: 5\r\n\r\nhello", (400, None)),
    "space in a header name": (H + b"X Request: a\r\nContent-Length: 5\r\n\r\nhello", (400, None)),
    "header without a colon": (H + b"XRequest\r\nContent-Length: 5\r\n\r\nhello", (400, None)),
    "head with bare LF": (b"POST /echo HTTP/1.1\nHost: x\nContent-Length: 5\n\nhello", (400, None)),
    "trailer trying to set X-Request-Id": (
        H + b"X-Request-Id: real\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n"
        b"X-Request-Id: smuggled\r\n\r\n", (200, b"hello")),
    "CONNECT": (b"CONNECT evil:443 HTTP/1.1\r\nHost: evil:443\r\n\r\n", (400, None)),
    "HTTP/2 preface": (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", (400, None)),
    "Upgrade: h2c": (
        H + b"Upgrade: h2c\r\nConnection: Upgrade\r\nContent-Length: 5\r\n\r\nhello", (400, None)),
    "HTTP/9.9": (b"POST /echo HTTP/9.9\r\nContent-Length: 5\r\n\r\nhello", (400, None)),
    "lower-case method": (b"post /echo HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", (400, None)),
    "NUL in the path": (b"POST /ec\x00ho HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", (400, None)),
    "space in the path": (b"POST /ec ho HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", (400, None)),
    "absolute-form target": (
        b"POST http://evil/echo HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", (404, None)),
    "Expect: 100-continue with a 1 TB body": (
        H + b"Expect: 100-continue\r\nContent-Length: 999999999999\r\n\r\n", (413, None)),
    "head over 64 KiB": (H + b"X-Big: " + b"y" * 70_000 + b"\r\n\r\n", (431, None)),
}  # fmt: skip
# Where uvicorn 0.54 with httptools answers otherwise (written down in docs/benchmarks.md)
UVICORN_DIFFERS: dict[str, tuple[int | None, bytes | None]] = {
    "TE: xchunked": (400, None),  # refused by llhttp, as Bad Request rather than 501
    "TE: identity, chunked": (200, b"hello"),  # an unknown coding before chunked: ignored
    "TE in an HTTP/1.0 request": (200, b"hello"),  # RFC 9112 6.1 says faulty framing
    "Upgrade: h2c": (200, b""),  # the body is taken for the new protocol: the app gets b""
    "absolute-form target": (200, b"hello"),  # routed by its path
    "Expect: 100-continue with a 1 TB body": (100, None),  # no body limit: "send it"
    "head over 64 KiB": (200, b""),  # no head limit (and no body sent)
}  # and a trailer joins the headers (see the test below)

Runner = Callable[[Callable[[], Awaitable[None]]], None]
REFUSED = (400, 413, 431, 501)  # answers after which the server closes the connection
ANSWER_S = 30.0  # a deadline for an answer or a close that is due: a busy machine is slow


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Runner:
    factory = uvloop.new_event_loop if request.param == "uvloop" else None

    def go(coro: Callable[[], Awaitable[None]]) -> None:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(asyncio.wait_for(coro(), 120))

    return go


class Recorder:
    """Routes /echo (POST and GET) and /ok; keeps every request that reached a handler."""

    def __init__(self) -> None:
        self.seen: list[Request] = []

    async def echo(self, request: Request, _reply: Reply) -> Response:
        self.seen.append(request)
        return Response(200, request.body, {"Content-Type": "text/plain"})

    async def ok(self, _request: Request, _reply: Reply) -> Response:
        return json_response({"ok": True})

    def server(self) -> Server:
        server = Server()
        server.add("POST", "/echo", self.echo)
        server.add("GET", "/smuggled", self.echo)
        server.add("GET", "/ok", self.ok)
        return server


@asynccontextmanager
async def own_server(server: Server) -> AsyncIterator[int]:
    await server.serve("127.0.0.1", 0)
    assert server._server is not None
    try:
        yield server._server.sockets[0].getsockname()[1]
    finally:
        await server.shutdown(timeout_s=1)


@asynccontextmanager
async def uvicorn_server(server: Server) -> AsyncIterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = uvicorn.Config(
        asgi_app(server), host="127.0.0.1", port=port, http="httptools", loop="none",
        lifespan="off", log_level="critical", access_log=False,
    )  # fmt: skip
    userver = uvicorn.Server(config)
    task = asyncio.create_task(userver.serve())
    while not userver.started:
        await asyncio.sleep(0.02)
    try:
        yield port
    finally:
        userver.should_exit = True
        await task


async def outcome(port: int, data: bytes) -> tuple[int | None, bool]:
    """(status of the first answer or None, whether the server closed the connection). After a
    refusal the close is due, and awaited; otherwise a short look only tells whether it came."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    first = await asyncio.wait_for(reader.read(65536), ANSWER_S)  # an answer, or b"": closed
    status = int(first.split(b" ", 2)[1]) if first.startswith(b"HTTP/1.") else None
    try:
        closed = not first or (
            await asyncio.wait_for(reader.read(), ANSWER_S if status in REFUSED else 0.5) == b""
        )
    except TimeoutError:
        closed = False
    writer.close()
    return status, closed


async def tenant_ok(port: int) -> None:
    """Another client, on its own connection: answered."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), ANSWER_S)
    assert head.startswith(b"HTTP/1.1 200"), head
    writer.close()


async def run_corpus(port: int, recorder: Recorder) -> dict[str, tuple[int | None, bytes | None]]:
    results = {}
    for name, (data, _expected) in CORPUS.items():
        recorder.seen.clear()
        status, closed = await outcome(port, data)
        bodies = [r.body for r in recorder.seen]
        assert len(bodies) <= 1, (name, bodies)  # never a smuggled second request
        if status in REFUSED:
            assert closed, name  # a refused request's connection is never reused
        results[name] = (status, bodies[0] if bodies else None)
        await tenant_ok(port)
    return results


def test_the_corpus_is_refused_and_nothing_reaches_a_handler(run: Runner) -> None:
    assert len(CORPUS) >= 30

    async def main() -> None:
        recorder = Recorder()
        async with own_server(recorder.server()) as port:
            results = await run_corpus(port, recorder)
        assert results == {name: expected for name, (_d, expected) in CORPUS.items()}

    run(main)


def test_a_trailer_never_sets_a_header() -> None:
    async def main() -> None:
        recorder = Recorder()
        async with own_server(recorder.server()) as port:
            await outcome(port, CORPUS["trailer trying to set X-Request-Id"][0])
        assert recorder.seen[0].headers["x-request-id"] == "real"

    asyncio.run(main())


def test_slowloris_heads_and_endless_bodies_are_closed_and_others_served(
    run: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(httpserver, "KEEPALIVE_S", 3600.0)  # none is swept while tenants ask
    monkeypatch.setattr(httpserver, "SWEEP_S", 0.2)

    async def main() -> None:
        recorder = Recorder()
        server = recorder.server()
        async with own_server(server) as port:
            hostile = []
            for start, drip in [
                (b"POST /echo HTTP/1.1\r\nHost: x\r\nX-A: ", b"a"),  # a head never ended
                (H + b"Content-Length: 100000\r\n\r\n", b"b"),  # a body that never ends
                (H + b"Transfer-Encoding: chunked\r\n\r\n", b"1\r\nc\r\n"),  # chunks forever
            ] * 20:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(start)
                hostile.append((reader, writer, drip))
            deadline = asyncio.get_running_loop().time() + ANSWER_S
            while len(server.connections) < len(hostile):  # all accepted
                assert asyncio.get_running_loop().time() < deadline, len(server.connections)
                await asyncio.sleep(0.01)
            held = set(server.connections)
            for _ in range(8):  # they keep dripping; other clients are served meanwhile
                for _reader, writer, drip in hostile:
                    writer.write(drip)
                await tenant_ok(port)
                # answered while every hostile request is still open and unfinished: none of
                # them holds up another client, however long it drips
                assert not [conn for conn in held if conn.closed]
                await asyncio.sleep(0.1)
            monkeypatch.setattr(httpserver, "KEEPALIVE_S", 1.0)  # now the sweep closes them
            for reader, writer, _drip in hostile:  # closed by the sweep, never answered
                assert await asyncio.wait_for(reader.read(), ANSWER_S) == b""
                writer.close()
        assert recorder.seen == []

    run(main)


def test_uvicorn_answers_the_corpus_as_recorded() -> None:
    """The same corpus against uvicorn + httptools (raw ASGI app): equal except UVICORN_DIFFERS."""

    async def main() -> None:
        recorder = Recorder()
        async with uvicorn_server(recorder.server()) as port:
            results = await run_corpus(port, recorder)
            trailer = await outcome(port, CORPUS["trailer trying to set X-Request-Id"][0])
            assert trailer[0] == 200
            assert recorder.seen[-1].headers["x-request-id"] == "smuggled"  # merged into headers
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nX-A: ")  # a head never ended
            await asyncio.sleep(3)
            assert not reader.at_eof()  # still open: uvicorn has no head timeout
            writer.close()
        expected = {name: expected for name, (_d, expected) in CORPUS.items()}
        assert {n: r for n, r in results.items() if r != expected[n]} == UVICORN_DIFFERS

    asyncio.run(main())


# -- the real gateway, in front of a recording upstream -------------------------------------


class RecordingUpstream:
    """A stand-in for vLLM that records every byte it is sent and answers each request (framed
    by Content-Length, as the gateway sends them) with a short completion."""

    def __init__(self) -> None:
        self.received = b""
        self.requests: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            body = await reader.readexactly(length)
            self.received += head + body
            self.requests.append(head + body)
            doc = {
                "id": "cmpl-1",
                "object": "text_completion",
                "model": "m",
                "choices": [{"index": 0, "text": " hi", "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
            answer = json.dumps(doc).encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
                % (len(answer), answer)
            )
        writer.close()


def _gateway_request(extra: bytes, body: bytes | None = None, *, key: bytes = b"sk-a") -> bytes:
    payload = body if body is not None else json.dumps({"model": "m", "prompt": "x"}).encode()
    length = b"Content-Length: %d\r\n\r\n" % len(payload)
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer " + key + b"\r\n"
        + b"Content-Type: application/json\r\n" + extra + length + payload
    )  # fmt: skip


def test_the_gateway_forwards_nothing_hostile_and_serves_other_tenants(tmp_path: Path) -> None:
    async def main() -> None:
        upstream = RecordingUpstream()
        upstream_server = await asyncio.start_server(upstream.handle, "127.0.0.1", 0)
        upstream_port = upstream_server.sockets[0].getsockname()[1]
        config = parse_config(
            {
                "events_dir": str(tmp_path / "events"),
                "upstreams": {"u": {"url": f"http://127.0.0.1:{upstream_port}", "model": "m",
                                    "max_concurrent": 8}},
                "teams": {"a": {"keys": ["sk-a"]}, "b": {"keys": ["sk-b"]}},
            }
        )  # fmt: skip
        gateway = Gateway(config)
        await gateway.start()
        server = build_server(gateway)
        async with own_server(server) as port:
            prompt = json.dumps({"model": "m", "prompt": "x"}).encode()
            chunked = b"%x\r\n%b\r\n0\r\n" % (len(prompt), prompt)
            hostile = [
                _gateway_request(b"X-Request-Id: a\rGET /x\r\n"),
                _gateway_request(b"X-Request-Id: a\nInjected: 1\r\n"),
                _gateway_request(b"traceparent: 00-\x00\r\n"),
                _gateway_request(b"Transfer-Encoding: chunked\r\n"),  # CL.TE
                _gateway_request(b"Content-Length: 7\r\n"),  # two lengths
                _gateway_request(b"Transfer-Encoding: identity, chunked\r\n"),
                _gateway_request(b"Upgrade: h2c\r\nConnection: Upgrade\r\n"),
                _gateway_request(b"X-Request-Id: a\r\n folded\r\n"),
            ]
            for data in hostile:
                status, closed = await outcome(port, data)
                assert status is not None and 400 <= status <= 501 and closed, data
            assert upstream.requests == []
            # a trailer cannot choose the id sent upstream; the head's id is what goes
            head = (
                b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer sk-b\r\n"
                b"X-Request-Id: tenant-b-1\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            status, _closed = await outcome(port, head + chunked + b"X-Request-Id: evil\r\n\r\n")
            assert status == 200
            assert len(upstream.requests) == 1
            assert b"X-Request-Id: tenant-b-1\r\n" in upstream.requests[0]
            assert b"evil" not in upstream.received
            # other tenants meanwhile: slow hostile connections do not hold them up
            slow = []
            for _ in range(20):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Be")
                slow.append(writer)
            status, _closed = await outcome(port, _gateway_request(b"", key=b"sk-b"))
            assert status == 200 and len(upstream.requests) == 2
            for writer in slow:
                writer.close()
        await gateway.stop()
        upstream_server.close()

    asyncio.run(main())


def test_the_asgi_adapter_serves_a_plain_request() -> None:
    """The adapter the comparison runs on answers like the gateway's own server."""

    async def main() -> None:
        recorder = Recorder()
        async with uvicorn_server(recorder.server()) as port:
            status, _closed = await outcome(port, CORPUS["valid, chunked"][0])
        assert status == 200 and recorder.seen[0].body == b"hello"

    asyncio.run(main())
