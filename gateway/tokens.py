"""Prompt length as the upstream counts it: vLLM's `/tokenize`, with a bounded LRU cache.

Only teams with a `max_prompt_tokens` or a `token_budget` pay for the count; repeated prompts
(retries, agent loops, shared system prompts) are answered from the cache without a round trip.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any

import aiohttp


class TokenCounter:
    def __init__(self, session: aiohttp.ClientSession, *, capacity: int = 4096) -> None:
        self.session = session
        self.capacity = capacity
        self._cache: OrderedDict[tuple[str, str], int] = OrderedDict()

    async def count(self, base_url: str, model: str, body: dict[str, Any], chat: bool) -> int:
        """Tokens in the request's prompt (`prompt` or chat `messages`), as `base_url` counts."""
        if chat:
            query: dict[str, Any] = {"model": model, "messages": body.get("messages") or []}
        else:
            query = {"model": model, "prompt": body.get("prompt") or ""}
            if isinstance(query["prompt"], list) and all(
                isinstance(t, int) for t in query["prompt"]
            ):
                return len(query["prompt"])  # already token ids
        text = json.dumps(query, sort_keys=True, separators=(",", ":"))
        key = (base_url, hashlib.sha256(text.encode()).hexdigest())
        if (cached := self._cache.get(key)) is not None:
            self._cache.move_to_end(key)
            return cached
        async with self.session.post(
            f"{base_url}/tokenize", json=query, timeout=aiohttp.ClientTimeout(total=10)
        ) as resp:
            resp.raise_for_status()
            count = int((await resp.json())["count"])
        self._cache[key] = count
        if len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return count
