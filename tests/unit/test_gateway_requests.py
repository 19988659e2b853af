"""The gateway's request path in one process, over loopback, with upstreams that refuse every
connection (ports nothing listens on): every way a request is refused or fails before vLLM
would answer, each with its status, its answer and exactly one event. What vLLM's answers do
to a request is in tests/e2e/test_gateway_vllm.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from servescope.gateway import health
from servescope.gateway.config import parse_config
from servescope.gateway.server import Gateway, build_server
from servescope.store.settings import free_port


def _config(tmp_path: Path) -> dict[str, Any]:
    upstreams = {n: {"url": f"http://127.0.0.1:{free_port()}", "model": "m"} for n in ("r1", "r2")}
    return {
        "events_dir": str(tmp_path / "events"),
        "upstreams": {**upstreams, "spare": {"url": f"http://127.0.0.1:{free_port()}"}},
        "models": {
            "m": {"pool": ["r1", "r2"], "fallback": "spare"},
            "other": {"upstream": "spare"},
        },
        "teams": {"a": {"keys": ["sk-a"], "models": ["m"]}},
    }


def _events(tmp_path: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for path in sorted((tmp_path / "events").glob("gateway-*.events.jsonl"))
        for line in path.read_text().splitlines()
    ]


def test_refusals_and_dead_upstreams_each_answer_once_and_leave_one_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fallback is not probed: it reads down at /health only while its mark lasts, which
    # must outlast however long the requests before it take.
    monkeypatch.setattr(health, "DOWN_FOR_S", 3600.0)

    async def main() -> list[tuple[int, dict[str, str], dict[str, Any]]]:
        gateway = Gateway(parse_config(_config(tmp_path)))
        await gateway.start()
        server = build_server(gateway)
        await server.serve("127.0.0.1", 0)
        assert server._server is not None
        url = f"http://127.0.0.1:{server._server.sockets[0].getsockname()[1]}"
        key = {"Authorization": "Bearer sk-a"}
        sent = [
            ({}, {"model": "m", "prompt": "x"}),  # no key
            (key, b"{not json"),
            (key, {"model": "nope", "prompt": "x"}),
            (key, {"model": "other", "prompt": "x"}),  # not this team's
            ({**key, "X-Request-Id": "mine-1"}, {"model": "m", "prompt": "x", "stream": True}),
        ]
        answers = []
        try:
            async with aiohttp.ClientSession() as session:
                for headers, body in sent:
                    data = body if isinstance(body, bytes) else json.dumps(body).encode()
                    async with session.post(
                        f"{url}/v1/completions", data=data, headers=headers
                    ) as resp:
                        named = {k.lower(): v for k, v in resp.headers.items()}
                        answers.append((resp.status, named, await resp.json()))
                async with session.get(f"{url}/health") as resp:
                    answers.append((resp.status, {}, await resp.json()))
        finally:
            await server.shutdown(timeout_s=1)
            await gateway.stop()
        return answers

    answers = asyncio.run(main())
    statuses = [(status, body.get("error", {}).get("code")) for status, _, body in answers[:5]]
    assert statuses == [
        (401, "unknown_key"),
        (400, "bad_request"),
        (404, "unknown_model"),
        (403, "model_not_allowed"),
        (503, "upstream_unavailable"),
    ]
    status, headers, _ = answers[4]
    assert headers["retry-after"] == "2" and headers["x-request-id"] == "mine-1"
    assert answers[5][2]["upstreams"] == {"r1": "down", "r2": "down", "spare": "down"}

    events = _events(tmp_path)
    assert len(events) == 5  # one a request, whatever happened to it
    assert [e["error"] for e in events] == [
        "rejected:unknown_key",
        "rejected:bad_request",
        "rejected:unknown_model",
        "rejected:model_not_allowed",
        "rejected:upstream_unavailable",
    ]
    assert events[0]["team"] == "unknown" and events[1]["team"] == "a"
    assert all(e["status"] == "rejected" and e["source"] == "gateway" for e in events)
    assert all(e["request_id"].startswith("gw-") for e in events[:4])
    dead = events[4]
    assert dead["request_id"] == "mine-1" and "run_id" not in dead  # the client's own id
    assert dead["model"] == "m" and dead["stream"] is True and dead["routing"] == "round-robin"
    assert sorted(dead["failed_upstreams"]) == ["r1:connect", "r2:connect", "spare:connect"]
    assert dead["fallback"] is True and dead["http_status"] == 503
    # the last upstream tried, and why: the pool's replicas go last once the probes find
    # them down, so which one that is depends on the probes' timing
    assert headers["x-servescope-upstream"] == dead["upstream"]
    assert headers["x-servescope-route"] == dead["route_reason"]
    assert dead["queue_ms"] >= 0 and dead["e2e_ms"] >= dead["queue_ms"]


def test_a_bad_reload_keeps_the_running_config_and_counts_the_refusal(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    doc = _config(tmp_path)
    path.write_text(yaml.safe_dump(doc))
    gateway = Gateway(parse_config(doc, source=str(path)), path)
    running = gateway.config
    path.write_text(yaml.safe_dump({**doc, "teams": {"a": {"keys": ["sk-a"], "max_queue": -1}}}))
    assert not gateway.reload()
    assert gateway.config is running
    path.write_text(yaml.safe_dump({**doc, "teams": {"b": {"keys": ["sk-b"]}}}))
    assert gateway.reload()
    assert list(gateway.config.teams) == ["b"] and gateway.scheduler.teams["b"].team.name == "b"
    reloads = gateway.metrics.registry.get_sample_value
    assert reloads("servescope_gateway_config_reloads_total", {"outcome": "error"}) == 1
    assert reloads("servescope_gateway_config_reloads_total", {"outcome": "ok"}) == 1
    gateway.events.close()
