"""The servers of an experiment between its runs, through vLLM's own endpoints: started
together, their prefix cache emptied (`POST /reset_prefix_cache`), put to sleep and woken
(`POST /sleep`, `POST /wake_up`, `GET /is_sleeping`) — what lets one server per arm stay up
across rounds and still start every run from the same state.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from servescope.loadgen.launcher import VllmServer

DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}  # vLLM serves POST /reset_prefix_cache only then
# … and POST /sleep, /wake_up, GET /is_sleeping with this flag, which also makes it allocate the
# weights and the KV cache where a sleep can release them (its cumem allocator)
SLEEP_FLAGS = ["--enable-sleep-mode"]
# level 1: the weights offloaded to CPU memory (a wake copies them back), the KV cache dropped;
# level 2 drops the weights too, and a wake would have to load them again
SLEEP_LEVEL = 1

# notes["repeat_state"]: the state a run's server started it in
STATE_FRESH = "fresh server"
STATE_RESET = "prefix cache reset"
STATE_WOKEN = "woken from sleep, prefix cache reset"
STATE_WARM = "warm: not reset (a --target server without dev mode)"
STATE_REFUSED = "warm: prefix cache reset refused (blocks still in use)"


def start_together(servers: list[VllmServer]) -> None:
    """Start servers at once, each waiting for its own /health. The first that fails (or a
    Ctrl-C) stops them all, so no start-up is waited out for nothing."""
    pool = ThreadPoolExecutor(max_workers=max(1, len(servers)))
    try:
        futures = [pool.submit(server.start) for server in servers]
        for future in futures:
            future.result()
    except BaseException:
        for server in servers:
            server.stop()  # a start still waiting sees its process gone and returns
        raise
    finally:
        pool.shutdown(wait=True)


class ResetUnavailable(RuntimeError):
    """The server does not serve `POST /reset_prefix_cache` (vLLM without dev mode)."""


def reset_prefix_cache(url: str, *, attempts: int = 20, wait_s: float = 0.25) -> str:
    """Empty the prefix cache of the vLLM at `url`, so a run starts cold without a restart.
    Returns the state the run starts in: STATE_RESET, or STATE_REFUSED when vLLM kept saying
    `success: false` (blocks still held); ResetUnavailable when it has no such endpoint."""
    for _ in range(attempts):
        request = urllib.request.Request(f"{url}/reset_prefix_cache", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                body = resp.read()
        except urllib.error.HTTPError as exc:
            if exc.code in (404, 405):
                raise ResetUnavailable(f"{url} has no /reset_prefix_cache ({exc.code})") from exc
            raise
        try:
            answer = json.loads(body or b"{}")
        except ValueError:
            answer = {}
        if not isinstance(answer, dict) or answer.get("success", True):
            return STATE_RESET  # older vLLMs answer 200 with no body
        time.sleep(wait_s)
    return STATE_REFUSED


class SleepFailed(RuntimeError):
    """A server that would not go to sleep or wake up (no `--enable-sleep-mode`, no dev mode,
    or vLLM refused); the message says which and what it answered."""


def is_sleeping(url: str) -> bool:
    """What the vLLM at `url` says of itself (`GET /is_sleeping`)."""
    try:
        with urllib.request.urlopen(f"{url}/is_sleeping", timeout=30) as resp:
            answer = json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        raise SleepFailed(f"{url}/is_sleeping answered {exc.code}") from exc
    if not isinstance(answer, dict) or not isinstance(answer.get("is_sleeping"), bool):
        raise SleepFailed(f"{url}/is_sleeping answered {answer!r}")
    return answer["is_sleeping"]


def set_sleeping(
    url: str,
    asleep: bool,
    *,
    level: int = SLEEP_LEVEL,
    timeout_s: float = 300.0,
    poll_s: float = 0.1,
) -> float:
    """Put the vLLM at `url` to sleep at `level` (`POST /sleep`) or wake it (`POST /wake_up`,
    all of its memory), and return the seconds until it said it was so (`GET /is_sleeping`).
    vLLM answers both once its engine has done it; the look that follows is what proves it,
    since an older engine answered before it was done. SleepFailed when it refuses, lacks the
    endpoints or never gets there."""
    path = f"sleep?level={level}" if asleep else "wake_up"
    began = time.monotonic()
    request = urllib.request.Request(f"{url}/{path}", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            resp.read()
    except urllib.error.HTTPError as exc:
        raise SleepFailed(
            f"{url}/{path} answered {exc.code}: sleep mode needs --enable-sleep-mode and "
            "VLLM_SERVER_DEV_MODE=1"
        ) from exc
    while is_sleeping(url) != asleep:
        if time.monotonic() - began > timeout_s:
            state = "asleep" if asleep else "awake"
            raise SleepFailed(f"{url} not {state} {timeout_s:.0f} s after POST /{path}")
        time.sleep(poll_s)
    return time.monotonic() - began
