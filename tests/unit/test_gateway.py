"""The gateway's config, scheduler and timing feed on their own (no server needed: pure asyncio,
YAML and bytes)."""

from __future__ import annotations

import asyncio
import hashlib
import re
from typing import Any

import pytest

from servescope.gateway.admission import Rejected, Scheduler
from servescope.gateway.config import ConfigError, Team, key_digest, parse_config
from servescope.gateway.timing import RelayTiming
from servescope.wire.stream import COMPLETIONS

BASE: dict[str, Any] = {
    "upstreams": {"u": {"url": "http://127.0.0.1:9", "model": "m", "max_concurrent": 4}},
    "teams": {"a": {"keys": ["sk-a"]}, "b": {"key_sha256": [hashlib.sha256(b"sk-b").hexdigest()]}},
}


def team(name: str, **kw: Any) -> Team:
    return Team(name=name, key_digests=(key_digest(name),), **kw)


def test_config_keys_are_kept_as_digests_and_matched() -> None:
    config = parse_config(BASE)
    assert config.team_for_key("sk-a").name == "a"
    assert config.team_for_key("sk-b").name == "b"
    assert config.team_for_key("sk-c") is None
    assert config.team_for_key(None) is None
    assert "sk-a" not in repr(config)
    assert config.routes["m"].upstream == "u"  # default route: the upstream's served name


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"teams": {"a": {}}}, "needs `keys` or `key_sha256`"),
        ({"teams": {"a": {"keys": ["k"], "max_queue": -1}}},
         "gateway.yaml: teams.a.max_queue: expected an integer ≥ 0, got -1"),
        ({"teams": {"a": {"keys": ["k"], "weight": "ten"}}},
         "teams.a.weight: expected a number, got \"ten\""),
        ({"teams": {"a": {"keys": ["k"], "token_budget": {"tokens": 1.5}}}},
         "teams.a.token_budget.tokens: expected an integer, got 1.5"),
        ({"teams": {"a": {"key_sha256": ["abc"]}}},
         "teams.a.key_sha256[0]: expected a string of 64 hex digits, got \"abc\""),
        ({"teams": {"a": {"keys": ["k"], "colour": "red"}}}, "teams.a: unknown key 'colour'"),
        ({"teams": {}}, "teams: expected a mapping of length ≥ 1"),
        ({"colour": "red"}, "gateway.yaml: unknown key 'colour' (known: defaults, events_dir"),
        ({"teams": {"a": {"keys": ["k"]}, "b": {"keys": ["k"]}}}, "shared by teams"),
        ({"models": {"m": {"upstream": "nope"}}}, "is not an upstream"),
        ({"upstreams": {"u": {"url": "ftp://x"}}}, "must be an http:// URL"),
        ({"listen": {"port": "x"}}, "listen.port: expected an integer, got \"x\""),
    ],
)  # fmt: skip
def test_config_errors_name_the_field(patch: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config({**BASE, **patch})


def test_strict_priority_then_weighted_fairness_then_fifo() -> None:
    async def scenario() -> list[tuple[str, int]]:
        teams = {
            "hi": team("hi", priority=10, max_concurrent=10, max_queue=10),
            "w2": team("w2", weight=2, max_concurrent=10, max_queue=10),
            "w1": team("w1", weight=1, max_concurrent=10, max_queue=10),
            "low": team("low", priority=-1),
        }
        scheduler = Scheduler(teams, {"u": 1})
        blocker = await scheduler.admit("low", "u")  # the upstream's only slot
        order: list[tuple[str, int]] = []

        async def one(name: str, seq: int) -> None:
            slot = await scheduler.admit(name, "u")
            order.append((name, seq))
            await asyncio.sleep(0)
            slot.release()

        tasks = [asyncio.create_task(one("w1", i)) for i in range(3)]
        tasks += [asyncio.create_task(one("w2", i)) for i in range(4)]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(one("hi", 0)))
        await asyncio.sleep(0)
        blocker.release()
        await asyncio.gather(*tasks)
        return order

    order = asyncio.run(scenario())
    assert order[0] == ("hi", 0)  # strict priority, although it arrived last
    names = [name for name, _ in order[1:]]
    assert names[:6].count("w2") == 4  # twice w1's weight: two of every three admissions
    for name in ("w1", "w2"):  # FIFO within a team
        seqs = [seq for n, seq in order if n == name]
        assert seqs == sorted(seqs)


def test_a_team_at_its_own_limit_never_delays_another() -> None:
    async def scenario() -> tuple[float, int]:
        teams = {
            "a": team("a", max_concurrent=1, max_queue=3),
            "b": team("b", max_concurrent=2, max_queue=2),
        }
        scheduler = Scheduler(teams, {"u": 8})
        held = await scheduler.admit("a", "u")
        waiting = [asyncio.create_task(scheduler.admit("a", "u")) for _ in range(3)]
        await asyncio.sleep(0)
        with pytest.raises(Rejected) as excinfo:
            await scheduler.admit("a", "u")
        assert excinfo.value.reason == "queue_full" and excinfo.value.http_status == 429
        assert excinfo.value.retry_after_s is not None
        b_admit = asyncio.create_task(scheduler.admit("b", "u"))
        await asyncio.sleep(0)  # one turn of the loop: the task's first step
        assert b_admit.done()  # admitted without ever waiting behind a's queue
        b_slot = await asyncio.wait_for(b_admit, 10)
        queue_ms = b_slot.queue_ms
        b_slot.release()
        held.release()
        for task in waiting:
            (await task).release()
        return queue_ms, scheduler.inflight["u"]

    queue_ms, inflight = asyncio.run(scenario())
    assert queue_ms < 1000  # not queued: only the admission's own work, however slow the machine
    assert inflight == 0


def test_queue_timeout_and_cancelled_waiters_free_their_place() -> None:
    async def scenario() -> None:
        teams = {"a": team("a", max_concurrent=1, max_queue=2, queue_timeout_s=0.05)}
        scheduler = Scheduler(teams, {"u": 8})
        held = await scheduler.admit("a", "u")
        with pytest.raises(Rejected) as excinfo:
            await scheduler.admit("a", "u")
        assert excinfo.value.reason == "queue_timeout" and excinfo.value.http_status == 503
        gone = asyncio.create_task(scheduler.admit("a", "u"))
        await asyncio.sleep(0)
        assert scheduler.queue_depth("a") == 1
        gone.cancel()
        await asyncio.sleep(0.01)
        assert scheduler.queue_depth("a") == 0
        held.release()
        assert scheduler.teams["a"].active == 0 and scheduler.inflight["u"] == 0

    asyncio.run(scenario())


def test_token_budget_rejects_with_the_window_reset_as_retry_after() -> None:
    from servescope.gateway.config import TokenBudget

    async def scenario() -> None:
        teams = {"a": team("a", token_budget=TokenBudget(tokens=100, window_s=60))}
        scheduler = Scheduler(teams, {"u": 8})
        slot = await scheduler.admit("a", "u", prompt_tokens=10)
        slot.charge(95)
        slot.release()
        with pytest.raises(Rejected) as excinfo:
            await scheduler.admit("a", "u", prompt_tokens=10)
        assert excinfo.value.reason == "token_budget" and excinfo.value.http_status == 429
        assert 50 < (excinfo.value.retry_after_s or 0) <= 60

    asyncio.run(scenario())


def test_reload_keeps_live_counts_and_applies_new_limits() -> None:
    async def scenario() -> None:
        scheduler = Scheduler({"a": team("a", max_concurrent=1, max_queue=4)}, {"u": 8})
        held = await scheduler.admit("a", "u")
        waiter = asyncio.create_task(scheduler.admit("a", "u"))
        await asyncio.sleep(0)
        assert not waiter.done()
        scheduler.configure({"a": team("a", max_concurrent=2, max_queue=4)}, {"u": 8})
        # the raised limit admits it at once: in the reload itself, before the loop turns
        assert scheduler.queue_depth("a") == 0 and scheduler.teams["a"].active == 2
        slot = await asyncio.wait_for(waiter, 10)
        slot.release()
        held.release()
        assert scheduler.teams["a"].active == 0

    asyncio.run(scenario())


# --- the gateway's feed of the timing rules equals bench's ---------------------------------------


def test_relay_timing_takes_the_shortcut_for_vllm_shaped_tokens() -> None:
    """The shortcut must actually be taken, or the cost it saves is back."""
    line = (
        'data: {"id":"cmpl-x","object":"text_completion","created":1,"model":"m","choices":'
        '[{"index":0,"text":"%s","logprobs":null,"finish_reason":null,"stop_reason":null}],'
        '"usage":null}'
    )
    decoded: list[bytes] = []

    class Counting(RelayTiming):
        __slots__ = ()

        def feed_line(self, line: bytes, now: float) -> dict[str, Any] | None:
            decoded.append(line)
            return super().feed_line(line, now)

    timing = Counting(COMPLETIONS, 0.0)
    tokens = ["first", " next", "é", '\\"', " last"]
    timing.feed("".join(line % t + "\n\n" for t in tokens).encode(), 1.0)
    assert decoded == [(line % t).encode() for t in ("first", '\\"')]  # the template, an escape
    assert (timing.first, timing.last, timing.gaps) == (1.0, 1.0, [0.0] * 4)
