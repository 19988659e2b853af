"""operator_traffic.py BASE MODEL — an operator's traffic, as a user's scripts send it: no
X-Request-Id, completions and chats with a shared 2,000-token prefix, four at a time, plus three
requests vLLM refuses with 400. Prints one JSON line of what the client saw, the count a
collector must reproduce from vLLM's log."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

PREFIX = " ".join(f"w{i % 500}" for i in range(2000))


def post(base: str, path: str, body: dict) -> int:
    req = urllib.request.Request(
        base + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as exc:
        exc.read()
        return exc.code


def main() -> None:
    base, model = sys.argv[1], sys.argv[2]
    calls = []
    for i in range(20):
        body = {"model": model, "max_tokens": 64, "ignore_eos": True}
        if i % 2:
            calls.append(("/v1/completions", {**body, "prompt": f"{PREFIX} q{i}"}))
        else:
            chat = [{"role": "user", "content": f"{PREFIX} q{i}"}]
            calls.append(("/v1/chat/completions", {**body, "messages": chat}))
    calls += [
        ("/v1/completions", {"model": model, "prompt": "x", "max_tokens": 100000}),
        ("/v1/completions", {"model": model, "prompt": "x", "temperature": -1}),
        ("/v1/chat/completions", {"model": model, "messages": [], "max_tokens": 8}),
    ]  # fmt: skip
    with ThreadPoolExecutor(4) as pool:
        statuses = list(pool.map(lambda c: post(base, *c), calls))
    print(
        json.dumps(
            {
                "sent": len(statuses),
                "by_status": {str(s): statuses.count(s) for s in sorted(set(statuses))},
            }
        )
    )


if __name__ == "__main__":
    main()
