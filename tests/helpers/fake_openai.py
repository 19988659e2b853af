"""A stand-in OpenAI-compatible server for `bench run`'s own tests: a tokenizer of words, streamed
completions and chats of `max_tokens` chunks, `/metrics` with a few vLLM counters that grow with
each page. It keeps what it was sent, so a test can see what the client asked for. Runs in the
test's own event loop (`async with FakeOpenAI() as server`)."""

from __future__ import annotations

import asyncio
import json
from types import TracebackType
from typing import Any

from aiohttp import web

from servescope.store import settings


class FakeOpenAI:
    """`fail_every`: every n-th generation request answers 500 (0: none)."""

    def __init__(self, *, fail_every: int = 0, token_delay_s: float = 0.001) -> None:
        self.fail_every = fail_every
        self.token_delay_s = token_delay_s
        self.bodies: list[dict[str, Any]] = []  # every generation request's body, in order
        self.request_ids: list[str] = []  # … and its X-Request-Id
        self.pages = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> FakeOpenAI:
        app = web.Application()
        app.add_routes(
            [
                web.get("/v1/models", self._models),
                web.get("/version", self._version),
                web.post("/tokenize", self._tokenize),
                web.post("/detokenize", self._detokenize),
                web.get("/metrics", self._metrics),
                web.post("/v1/completions", self._generate),
                web.post("/v1/chat/completions", self._generate),
            ]
        )
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        port = settings.free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(
        self,
        _kind: type[BaseException] | None,
        _exc: BaseException | None,
        _tb: TracebackType | None,
    ) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake"}]})

    async def _version(self, _request: web.Request) -> web.Response:
        return web.json_response({"version": "0.0.fake"})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        words = len(body["prompt"].split())
        special = 1 if body.get("add_special_tokens", True) else 0
        return web.json_response({"tokens": list(range(words + special))})

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"prompt": " ".join("w" for _ in body["tokens"])})

    async def _metrics(self, _request: web.Request) -> web.Response:
        self.pages += 1
        n = self.pages
        text = (
            f'vllm:prefix_cache_hits_total{{model_name="fake"}} {n * 3}\n'
            f'vllm:prefix_cache_queries_total{{model_name="fake"}} {n * 10}\n'
            f'vllm:num_requests_running{{model_name="fake"}} {n % 4}\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.request_ids.append(request.headers.get("X-Request-Id", ""))
        if self.fail_every and len(self.bodies) % self.fail_every == 0:
            return web.json_response({"error": "boom"}, status=500)
        chat = "messages" in body
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        n = int(body.get("max_tokens", 4))
        for i in range(n):
            await asyncio.sleep(self.token_delay_s)
            choice: dict[str, Any] = (
                {"index": 0, "delta": {"content": f"t{i} "}}
                if chat
                else {"index": 0, "text": f"t{i} "}
            )
            choice["finish_reason"] = "length" if i == n - 1 else None
            await response.write(_sse({"id": "c", "choices": [choice]}))
        usage = {
            "prompt_tokens": 10,
            "completion_tokens": n,
            "total_tokens": 10 + n,
            "prompt_tokens_details": {"cached_tokens": 3},
        }
        await response.write(_sse({"id": "c", "choices": [], "usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        return response


def _sse(doc: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(doc)}\n\n".encode()
