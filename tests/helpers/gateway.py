"""The gateway as the end-to-end tests run it: its process with a config in front of a real vLLM,
its events and metrics read back, the teams' keys, and requests sent through it."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from servescope.store.settings import free_port
from tests.helpers.cli import ROOT, SERVESCOPE, read_events
from tests.helpers.vllm import RunningServer

KEYS = {
    "a": "sk-team-a-7f3c9e1d2b4a",
    "b": "sk-team-b-0a9e8d7c6b5f",
    "c": "sk-team-c-5e4d3c2b1a09",
}


HOLD_TOKENS = 16000  # keeps a slot busy for a minute or more (the server's max_model_len: 16384)


@dataclass
class Gateway:
    url: str
    process: subprocess.Popen[bytes]
    config_path: Path
    log: Path
    events_dir: Path

    def events(self, expect: int | None = None) -> list[dict[str, Any]]:
        """The events written so far. The gateway writes a request's event right after the
        client has its last byte, so a test that knows how many to expect waits for them (until
        they are there, up to 120 s: a busy machine can hold the gateway back for seconds), then
        for the file to stop growing."""

        def read() -> list[dict[str, Any]]:
            return [e for f in sorted(self.events_dir.glob("gateway-*.events.jsonl"))
                    for e in read_events(f)]  # fmt: skip

        deadline = time.monotonic() + 120
        seen = read()
        while expect is not None and len(seen) < expect and time.monotonic() < deadline:
            time.sleep(0.05)
            seen = read()
        while True:
            time.sleep(0.2)
            now = read()
            if len(now) == len(seen):
                return now
            seen = now

    def metrics_text(self) -> str:
        # 30 s: a busy machine can be slow to run the gateway; a poll gets its value late, not
        # an error
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as resp:
            return resp.read().decode()

    def samples(self, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        out = {}
        for family in text_string_to_metric_families(self.metrics_text()):
            for s in family.samples:
                if s.name == name:
                    out[tuple(sorted(s.labels.items()))] = s.value
        return out

    def assert_no_keys(self) -> None:
        """Keys never reach logs, events or metrics."""
        texts = {
            "log": self.log.read_text(errors="replace"),
            "events": "".join(f.read_text() for f in self.events_dir.glob("*")),
            "metrics": self.metrics_text(),
        }
        for where, text in texts.items():
            for key in KEYS.values():
                assert key not in text, f"an API key appears in the gateway's {where}"


def write_config(path: Path, config: dict[str, Any], events_dir: Path) -> None:
    path.write_text(yaml.safe_dump({**config, "events_dir": str(events_dir)}))


@contextlib.contextmanager
def gateway(tmp_path: Path, config: dict[str, Any]) -> Iterator[Gateway]:
    port = free_port()
    events_dir = tmp_path / "events"
    config_path = tmp_path / "gateway.yaml"
    write_config(config_path, config, events_dir)
    log = tmp_path / "gateway.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*SERVESCOPE, "gateway", "--config", str(config_path), "--port", str(port)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1):
                break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"gateway did not start:\n{log.read_text()}")
            time.sleep(0.1)
    gw = Gateway(url, process, config_path, log, events_dir)
    try:
        yield gw
        gw.assert_no_keys()
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            assert process.wait(timeout=15) == 0, "the gateway did not exit 0 on SIGTERM"
        finally:
            if process.poll() is None:
                process.kill()


def one_upstream(vllm: RunningServer, teams: dict[str, Any], cap: int = 16) -> dict[str, Any]:
    return {
        "upstreams": {"main": {"url": vllm.url, "model": "tiny", "max_concurrent": cap}},
        "models": {"tiny": {"upstream": "main"}},
        "teams": teams,
    }


def auth(team: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[team]}"}


async def post(
    session: aiohttp.ClientSession, url: str, team: str | None, body: dict[str, Any], rid: str
) -> tuple[int, dict[str, str], str]:
    headers = {"X-Request-Id": rid, **(auth(team) if team else {})}
    async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
        return resp.status, dict(resp.headers), await resp.text()


def short(max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "the gateway admits", "max_tokens": max_tokens,
            "ignore_eos": True, **extra}  # fmt: skip


async def until_inflight(
    gw: Gateway, n: int, timeout_s: float = 120.0, *, hold: asyncio.Task[Any] | None = None
) -> None:
    """Wait until the gateway reports `n` requests running upstream, over all teams (a request
    sent is not yet an admitted one on a busy machine). /metrics is read in a thread, so that
    the requests awaited go on meanwhile; `hold`, the request meant to make the count, ending
    first ends the wait with what it got."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            inflight = await asyncio.to_thread(gw.samples, "servescope_gateway_inflight")
            if sum(inflight.values()) == n:
                return
        except OSError:  # the gateway slow to answer on a busy machine: ask again
            pass
        if hold is not None and hold.done():
            raise AssertionError(f"the request ended before {n} were in flight: {hold.result()}")
        assert time.monotonic() < deadline, f"never {n} in flight"
        await asyncio.sleep(0.02)


async def until_reloaded(gw: Gateway, outcome: str, count: int, timeout_s: float = 60.0) -> None:
    """Wait until the gateway has counted `count` SIGHUP reloads of `outcome` (it handles the
    signal when its event loop next runs: late, on a busy machine)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            reloads = await asyncio.to_thread(gw.samples, "servescope_gateway_config_reloads_total")
            if reloads.get((("outcome", outcome),), 0.0) >= count:
                return
        except OSError:  # the gateway slow to answer on a busy machine: ask again
            pass
        assert time.monotonic() < deadline, f"no {outcome} reload counted in {timeout_s:.0f} s"
        await asyncio.sleep(0.05)


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
