"""Prompts of an exact token count, as the target server counts them.

Text is drawn from a seeded word stream (or, for a workload's `text: passage | decoy`, from the
predictable tiny model's passage: `passage_text`, `decoy_text`), tokenized by the server's own
`/tokenize`, cut to the wanted length, detokenized, and re-counted; the cut is corrected until
the server counts exactly `n` tokens. Should the text never settle (a tokenizer whose round trip
drifts), the prompt is sent as the token ids themselves, which every OpenAI-compatible vLLM
endpoint accepts.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable

import aiohttp

from servescope.loadgen.client import get_json
from servescope.loadgen.plan import RequestPlan, prefix_size, rng_for
from servescope.loadgen.request import Message, Prompt, RequestBody
from servescope.loadgen.tiny_model import PASSAGE
from servescope.loadgen.workload import Workload

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


def seeded_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def passage_text(rng: random.Random, words: int) -> str:
    """The predictable model's passage, quoted in a cycle from a seeded word: the model's
    continuation is text the prompt already holds (what the n-gram drafter looks up)."""
    start = rng.randrange(len(PASSAGE))
    return " ".join(PASSAGE[(start + i) % len(PASSAGE)] for i in range(words))


def decoy_text(rng: random.Random, words: int) -> str:
    """Triples `w[i] w[i+1] X` of passage words, shuffled, with X never the passage's w[i+2]:
    every word pair the model will say is in the prompt (so drafts are proposed), but followed
    by another word (so they are rejected)."""
    n = len(PASSAGE)
    out: list[str] = []
    while len(out) < words:
        for i in rng.sample(range(n), n):
            wrong = (i + rng.randrange(3, n)) % n  # any word but w[i+2]
            out += [PASSAGE[i], PASSAGE[(i + 1) % n], PASSAGE[wrong]]
    return " ".join(out[:words])


TEXTS: dict[str, Callable[[random.Random, int], str]] = {
    "words": seeded_text,
    "passage": passage_text,
    "decoy": decoy_text,
}


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

    async def exact(
        self,
        n: int,
        rng: random.Random,
        prefix: str = "",
        text: Callable[[random.Random, int], str] = seeded_text,
    ) -> Prompt:
        """A prompt of exactly `n` tokens starting with `prefix` (which must be shorter), the
        rest drawn from `text` (one of TEXTS)."""
        specials = await self.specials()
        words = max(8, n)
        while True:
            ids = await self.count(prefix + text(rng, words), special=False)
            if len(ids) >= n:
                break
            words *= 2
        keep = n - specials
        for _ in range(8):
            decoded = await self.detokenize(ids[:keep])
            counted = len(await self.count(decoded))
            if counted == n:
                return decoded
            keep += n - counted
            if not 0 < keep <= len(ids):
                break
        return (await self.count(prefix + text(rng, words)))[:n]


def payload_for(prompt: Prompt, model: str, output_tokens: int, *, chat: bool) -> RequestBody:
    """The request body: `max_tokens` with `ignore_eos` makes the output length exact (a chat
    body's user message is a text prompt)."""
    body: RequestBody = {
        "model": model,
        "max_tokens": output_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": str(prompt)}]
    else:
        body["prompt"] = prompt
    return body


def prompt_digest(body: RequestBody) -> str:
    """A short fingerprint of a request's prompt: equal digests mean identical prompts."""
    prompt = body.get("messages") if "messages" in body else body.get("prompt")
    return hashlib.sha256(json.dumps(prompt, sort_keys=True).encode()).hexdigest()[:16]


class PromptBook:
    """The prompts of one workload: its shared static prefix (made once) and each request's own
    part. A completions prompt is prefix + part, exactly `prefix + input_tokens` tokens; a chat
    request carries the prefix as its system message and the part as the user message."""

    def __init__(self, maker: PromptMaker, workload: Workload, scale: float) -> None:
        self.maker = maker
        self.workload = workload
        self.prefix_tokens = prefix_size(workload, scale)
        self.chat = workload.endpoint == "chat"
        self.text = TEXTS[workload.text]
        self._prefix: str | None = None

    async def prefix(self) -> str:
        if self._prefix is None:
            self._prefix = ""
            if self.prefix_tokens:
                rng = rng_for(self.workload, "prefix", "text")
                made = await self.maker.exact(self.prefix_tokens, rng, text=self.text)
                self._prefix = made if isinstance(made, str) else await self.maker.detokenize(made)
        return self._prefix

    async def part(self, plan: RequestPlan) -> str:
        """The request's own text (an agent turn's new user message)."""
        made = await self.maker.exact(
            plan.input_tokens, random.Random(plan.text_seed), text=self.text
        )
        return made if isinstance(made, str) else await self.maker.detokenize(made)

    async def body(self, plan: RequestPlan, model: str) -> RequestBody:
        prefix = await self.prefix()
        rng = random.Random(plan.text_seed)
        if self.chat:
            messages: list[Message] = [{"role": "system", "content": prefix}] if prefix else []
            messages.append({"role": "user", "content": await self.part(plan)})
            body = payload_for("", model, plan.output_tokens, chat=True)
            body["messages"] = messages
            return body
        if prefix:
            prompt = await self.maker.exact(
                self.prefix_tokens + plan.input_tokens, rng, prefix=prefix + "\n", text=self.text
            )
        else:
            prompt = await self.maker.exact(plan.input_tokens, rng, text=self.text)
        return payload_for(prompt, model, plan.output_tokens, chat=False)
