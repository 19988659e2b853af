"""The gateway's routes served by uvicorn (httptools parser, uvloop) through a raw ASGI adapter,
for comparison with its own server (`gateway/httpserver.py`): `bench_gateway.py --server uvicorn`
measures its cost, tests/integration/test_gateway_hostile.py compares how each refuses hostile
clients.
Not for users: the gateway serves on `gateway/httpserver.py`.

    .venv/bin/python benchmarks/gateway_asgi.py --config gateway.yaml --port 8080
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from servescope.gateway.config import load_config  # noqa: E402
from servescope.gateway.httpserver import Request, Response, Server  # noqa: E402
from servescope.gateway.server import Gateway, build_server  # noqa: E402

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]


class AsgiReply:
    """`gateway.httpserver.Reply`'s interface over ASGI `send`: the handlers stream through it."""

    __slots__ = ("_send", "_start", "chunked", "prepared", "finished")

    def __init__(self, send: Send) -> None:
        self._send = send
        self._start: dict[str, Any] = {}
        self.chunked = True
        self.prepared = False
        self.finished = False

    def start(self, status: int, headers: dict[str, str]) -> None:
        self._start = {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()
            ],
        }

    async def write(self, data: bytes) -> None:
        if data:
            await self._body(data, True)

    async def write_eof(self, data: bytes = b"") -> None:
        if not self.finished:
            self.finished = True
            await self._body(data, False)

    async def _body(self, data: bytes, more: bool) -> None:
        if not self.prepared:
            self.prepared = True
            await self._send(self._start)
        await self._send({"type": "http.response.body", "body": data, "more_body": more})


def asgi_app(server: Server, gateway: Gateway | None = None) -> Callable[..., Awaitable[None]]:
    """A raw ASGI app dispatching to `server`'s routes (and starting/stopping `gateway`)."""

    async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    if gateway is not None:
                        await gateway.start()
                    gc.freeze()  # as gateway.server.serve does
                    gc.set_threshold(10_000)
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    if gateway is not None:
                        await gateway.stop()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        request = Request(
            method=scope["method"],
            path=scope["path"],
            headers=headers,
            body=body,
            keep_alive=True,
            http11=scope["http_version"] != "1.0",
        )
        reply = AsgiReply(send)
        answer = await server.dispatch(request, reply)  # type: ignore[arg-type]
        if isinstance(answer, Response):
            reply.start(answer.status, {**answer.headers, "content-length": str(len(answer.body))})
            await reply.write_eof(answer.body)
        elif not reply.finished:
            await reply.write_eof()

    return app


def gateway_args(description: str | None) -> argparse.Namespace:
    """The options of a benchmark's gateway entry point: `--config`, `--port`, `--host`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    return parser.parse_args()


def main() -> int:
    import uvicorn

    args = gateway_args(__doc__)
    gateway = Gateway(load_config(args.config), args.config)
    app = asgi_app(build_server(gateway), gateway)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        http="httptools",
        loop="uvloop",
        lifespan="on",
        access_log=False,
        log_level="warning",
        backlog=4096,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
