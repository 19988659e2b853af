"""The completion the benchmarks that start a tiny vLLM send it: one prompt, `tokens` tokens
exactly (`ignore_eos`), the answer read whole; its wall time is what they measure."""

from __future__ import annotations

import json
import time
import urllib.request


def complete(url: str, tokens: int, *, timeout_s: float) -> float:
    """Seconds one non-streaming completion of `tokens` tokens took at the server `url`
    (served as `tiny`)."""
    body = {"model": "tiny", "prompt": "the model reads a document and", "max_tokens": tokens,
            "ignore_eos": True}  # fmt: skip
    request = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    began = time.monotonic()
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
        resp.read()
    return time.monotonic() - began
