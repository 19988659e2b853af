"""Prompts of an exact token count, as the target server counts them.

Text is drawn from a seeded word stream, tokenized by the server's own `/tokenize`, cut to the
wanted length, detokenized, and re-counted; the cut is corrected until the server counts exactly
`n` tokens. Should the text never settle (a tokenizer whose round trip drifts), the prompt is
sent as the token ids themselves, which every OpenAI-compatible vLLM endpoint accepts.
"""

from __future__ import annotations

import random
from typing import Any

import aiohttp

from bench.client import get_json

WORDS = [
    "the",
    "model",
    "reads",
    "a",
    "long",
    "document",
    "and",
    "writes",
    "a",
    "short",
    "answer",
    "about",
    "serving",
    "latency",
    "cache",
    "batch",
    "queue",
    "token",
    "prompt",
    "decode",
    "prefill",
    "request",
    "team",
    "budget",
    "gateway",
    "metric",
    "trace",
    "span",
    "kernel",
    "memory",
    "block",
    "page",
    "scheduler",
    "worker",
    "engine",
    "stream",
    "chunk",
    "report",
    "review",
    "diff",
    "commit",
    "function",
    "class",
    "return",
    "value",
    "error",
    "retry",
    "timeout",
    "policy",
    "window",
    "limit",
    "rate",
    "burst",
    "agent",
    "tool",
    "plan",
    "step",
    "loop",
    "repository",
    "file",
    "line",
    "test",
    "build",
    "deploy",
    "monitor",
    "alert",
    "panel",
    "query",
    "percentile",
]

Prompt = str | list[int]


def seeded_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


class PromptMaker:
    """Exact-length prompts for one served model, using that server's tokenizer."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str) -> None:
        self.session = session
        self.base_url = base_url
        self.model = model
        self._specials: int | None = None

    async def count(self, text: str, *, special: bool = True) -> list[int]:
        body = {"model": self.model, "prompt": text, "add_special_tokens": special}
        result = await get_json(self.session, f"{self.base_url}/tokenize", body)
        return list(result["tokens"])

    async def detokenize(self, ids: list[int]) -> str:
        body = {"model": self.model, "tokens": ids}
        result = await get_json(self.session, f"{self.base_url}/detokenize", body)
        return str(result["prompt"])

    async def specials(self) -> int:
        """How many tokens (BOS…) the server adds to a completions prompt."""
        if self._specials is None:
            with_, without = await self.count("hello"), await self.count("hello", special=False)
            self._specials = len(with_) - len(without)
        return self._specials

    async def exact(self, n: int, rng: random.Random, prefix: str = "") -> Prompt:
        """A prompt of exactly `n` tokens starting with `prefix` (which must be shorter)."""
        specials = await self.specials()
        words = max(8, n)
        while True:
            ids = await self.count(prefix + seeded_text(rng, words), special=False)
            if len(ids) >= n:
                break
            words *= 2
        keep = n - specials
        for _ in range(8):
            text = await self.detokenize(ids[:keep])
            counted = len(await self.count(text))
            if counted == n:
                return text
            keep += n - counted
            if not 0 < keep <= len(ids):
                break
        return (await self.count(prefix + seeded_text(rng, words)))[:n]


def payload_for(prompt: Prompt, model: str, output_tokens: int, *, chat: bool) -> dict[str, Any]:
    """The request body: `max_tokens` with `ignore_eos` makes the output length exact."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": output_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body
