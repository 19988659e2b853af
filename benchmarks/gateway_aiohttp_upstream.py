"""The gateway with aiohttp's client on its proxy path instead of its own
(`gateway/upstream.py`): `bench_gateway.py --vs-aiohttp-client` runs both gateways on the same
load in the same run and reports the ratio. Not for users: the gateway proxies with
`gateway.upstream.UpstreamPool`.

    .venv/bin/python benchmarks/gateway_aiohttp_upstream.py --config gateway.yaml --port 8080

The pool below gives the proxy the interface of `UpstreamPool` / `UpstreamResponse` (status,
headers, `readany`, `read`, `at_eof`, `release`, `close`, failures as `UpstreamError`) over one
`aiohttp.ClientSession` with the connector the gateway uses off the hot path.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from servescope.gateway.config import load_config  # noqa: E402
from servescope.gateway.server import Gateway, serve  # noqa: E402
from servescope.gateway.upstream import CONNECT_TIMEOUT_S, UpstreamError  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_asgi import gateway_args  # noqa: E402

TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)


@contextmanager
def _disconnects() -> Iterator[None]:
    """aiohttp's failures while a response is read, as the proxy expects them."""
    try:
        yield
    except aiohttp.ClientError as exc:
        raise UpstreamError("disconnect", repr(exc)) from exc


class AiohttpResponse:
    """aiohttp's response as the proxy reads an `UpstreamResponse`."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.headers = response.headers

    def at_eof(self) -> bool:
        return self._response.content.at_eof()

    async def readany(self) -> bytes:
        with _disconnects():
            return await self._response.content.readany()

    async def read(self) -> bytes:
        with _disconnects():
            return await self._response.read()

    def release(self) -> None:
        self._response.release()

    def close(self) -> None:
        self._response.close()


class AiohttpPool:
    """`UpstreamPool`'s `post` and `close` over an aiohttp session (its connector pools)."""

    def __init__(self, base_url: str, session: aiohttp.ClientSession) -> None:
        self.base_url = base_url.rstrip("/")
        self.session = session

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> AiohttpResponse:
        try:
            response = await self.session.post(
                self.base_url + path, data=body, headers=headers, timeout=TIMEOUT
            )
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamError("connect", repr(exc)) from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError("disconnect", repr(exc)) from exc
        return AiohttpResponse(response)

    def close(self) -> None:
        """The session is the gateway's: it closes it on stop."""


class AiohttpGateway(Gateway):
    """The gateway, its proxy path on aiohttp's client."""

    def _pool(self, url: str) -> AiohttpPool:  # type: ignore[override]
        if (pool := self.pools.get(url)) is None:
            assert self.session is not None  # made by start()
            pool = self.pools[url] = AiohttpPool(url, self.session)  # type: ignore[assignment]
        return pool  # type: ignore[return-value]


def main() -> int:
    args = gateway_args(__doc__)
    gateway = AiohttpGateway(load_config(args.config), args.config)
    uvloop.run(serve(gateway, args.host, args.port))  # as `servescope gateway` runs
    return 0


if __name__ == "__main__":
    sys.exit(main())
