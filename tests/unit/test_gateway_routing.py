"""Replica pools and routing policies (gateway/routing.py, gateway/config.py) on their own: the
decisions are pure functions of the request, the ring and the outstanding counts. The routing
of real requests over two real vLLM replicas, one killed mid-run, is in
tests/e2e/test_fleet_vllm.py."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from servescope.gateway.config import ConfigError, Route, parse_config
from servescope.gateway.routing import HashRing, Router, affinity_key, routing_changes
from servescope.gateway.server import Gateway
from servescope.store import Store

POOL = ("r1", "r2", "r3")
UPSTREAMS = {n: {"url": f"http://127.0.0.1:{9000 + i}", "model": "m"} for i, n in enumerate(POOL)}
TEAMS = {"a": {"keys": ["sk-a"]}}


def route(policy: str, pool: tuple[str, ...] = POOL, **kw: Any) -> Route:
    return Route("m", pool, routing=policy, **kw)


def chat(system: str, user: str = "hi") -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def everyone_up(_name: str) -> bool:
    return True


def test_a_pool_route_parses_and_todays_routes_still_do() -> None:
    config = parse_config(
        {
            "upstreams": {**UPSTREAMS, "spare": {"url": "http://127.0.0.1:9100"}},
            "models": {
                "m": {"pool": list(POOL), "routing": "prefix-affinity", "fallback": "spare"},
                "plain": {"upstream": "r1", "fallback": "spare"},
            },
            "teams": TEAMS,
        }
    )
    pooled, plain = config.routes["m"], config.routes["plain"]
    assert pooled.pool == POOL and pooled.routing == "prefix-affinity"
    assert pooled.load_factor == 1.25 and pooled.prefix_chars == 256
    assert plain.pool == ("r1",) and plain.upstream == "r1" and plain.fallback == "spare"


@pytest.mark.parametrize(
    ("models", "message"),
    [
        ({"m": {"pool": ["r1", "nope"]}}, "models.m.pool 'nope' is not an upstream"),
        ({"m": {"pool": ["r1", "r2"], "routing": "random"}}, "routing must be one of"),
        ({"m": {"pool": ["r1", "r1"]}}, "names an upstream twice"),
        ({"m": {"pool": []}}, "models.m.pool: expected a list of length ≥ 1, got []"),
        ({"m": {"pool": ["r1"], "upstream": "r1"}}, "needs either `upstream` or `pool`"),
        ({"m": {"pool": ["r1", "r2"], "fallback": "r2"}}, "already in the pool"),
        ({"m": {"pool": ["r1", "r2"], "load_factor": 0.5}}, "load_factor: expected a number ≥ 1"),
        ({"m": {"upstream": "r1", "weights": [1]}}, "models.m: unknown key 'weights'"),
        ({"m": {"pool": ["r1", 2]}}, "models.m.pool[1]: expected a string, got 2"),
    ],
)
def test_pool_config_errors_name_the_field(models: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config({"upstreams": UPSTREAMS, "models": models, "teams": TEAMS})


def test_round_robin_takes_turns_and_skips_a_replica_that_is_down() -> None:
    router = Router()
    chosen = [router.plan(route("round-robin"), {}, False, everyone_up)[0] for _ in range(6)]
    assert [p.upstream for p in chosen] == ["r1", "r2", "r3", "r1", "r2", "r3"]
    assert {p.reason for p in chosen} == {"round-robin"}
    plan = router.plan(route("round-robin"), {}, False, lambda n: n != "r2")
    assert plan[0].upstream != "r2"
    assert [p.upstream for p in plan][-1] == "r2"  # tried last, not never
    assert [p.reason for p in plan[1:]] == ["retry", "retry"]


def test_least_outstanding_counts_queued_and_running_requests() -> None:
    router = Router()
    router.hold("r1")
    router.hold("r1")
    router.hold("r2")
    first = router.plan(route("least-outstanding"), {}, False, everyone_up)[0]
    assert (first.upstream, first.reason) == ("r3", "least-outstanding")
    router.let_go("r1")
    router.let_go("r1")
    router.hold("r3")
    # r1 has none now; r2 and r3 one each
    assert router.plan(route("least-outstanding"), {}, False, everyone_up)[0].upstream == "r1"


def test_prefix_affinity_sends_a_prefix_home_and_spreads_prefixes() -> None:
    router = Router()
    homes = {}
    for tenant in range(60):
        system = f"You are the assistant of tenant {tenant}. " * 20
        picks = {router.plan(route("prefix-affinity"), chat(system, u), True, everyone_up)[0]
                 for u in ("a", "b", "c")}  # fmt: skip
        assert len(picks) == 1  # every user message of a tenant goes to one replica
        (pick,) = picks
        assert pick.reason == "prefix-home"
        homes[tenant] = pick.upstream
    shares = Counter(homes.values())
    assert set(shares) == set(POOL) and min(shares.values()) >= 10  # 60 tenants over 3


def test_the_load_bound_spills_a_hot_prefix_to_the_same_next_replica() -> None:
    router = Router()
    hot = chat("the one hot system prompt " * 40)
    r = route("prefix-affinity", load_factor=1.25)
    placed = []
    for _ in range(30):  # 30 requests of one prefix, none finishing
        pick = router.plan(r, hot, True, everyone_up)[0]
        router.hold(pick.upstream)
        placed.append(pick)
    load = Counter(p.upstream for p in placed)
    home = placed[0].upstream
    assert placed[0].reason == "prefix-home"
    # no replica ever above ceil(1.25 × (L + 1) / 3) when it took a request
    assert max(load.values()) <= -(-1.25 * 30 // 3)
    assert load[home] == max(load.values())
    walk = HashRing(POOL).walk(affinity_key(hot, True, 256) or b"")
    assert walk[0] == home
    first_spill = next(p for p in placed if p.reason == "prefix-spill")
    assert first_spill.upstream == walk[1]  # the overflow goes to the next replica on the ring


def test_a_prefix_whose_home_is_down_fails_over_along_the_ring() -> None:
    router = Router()
    body = chat("tenant x system prompt " * 30)
    home = router.plan(route("prefix-affinity"), body, True, everyone_up)[0].upstream
    plan = router.plan(route("prefix-affinity"), body, True, lambda n: n != home)
    walk = HashRing(POOL).walk(affinity_key(body, True, 256) or b"")
    assert (plan[0].upstream, plan[0].reason) == (walk[1], "prefix-failover")
    assert plan[-1].upstream == home  # it comes back by itself: still in the plan, last
    # back up: home again
    assert router.plan(route("prefix-affinity"), body, True, everyone_up)[0].upstream == home


def test_affinity_keys() -> None:
    long = "x" * 1000
    assert affinity_key({"prompt": long}, False, 256) == b"x" * 256
    assert affinity_key({"prompt": [long, "y"]}, False, 8) == b"x" * 8
    assert affinity_key({"prompt": list(range(500))}, False, 40) == b"ids:" + b",".join(
        str(i).encode() for i in range(10)
    )
    parts = {"messages": [{"role": "system", "content": [{"type": "text", "text": "sys"}]}]}
    assert affinity_key(parts, True, 256) == b"sys"
    assert affinity_key({"messages": [{"role": "user", "content": "hello"}]}, True, 3) == b"hel"
    for nothing in ({}, {"prompt": ""}, {"prompt": 3}, {"messages": []}, {"messages": "x"}):
        assert affinity_key(nothing, "messages" in nothing, 256) is None
    router = Router()
    pick = router.plan(route("prefix-affinity"), {"prompt": ""}, False, everyone_up)[0]
    assert pick.reason == "no-prefix"


def test_a_ring_moves_only_the_keys_of_a_removed_replica() -> None:
    keys = [f"tenant-{i}".encode() for i in range(400)]
    before = {k: HashRing(POOL).walk(k)[0] for k in keys}
    after = {k: HashRing(("r1", "r3")).walk(k)[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == "r2" for k in moved)


def test_fallback_and_single_upstream_plans_are_todays() -> None:
    router = Router()
    plain = Route("m", ("r1",), fallback="r2")
    assert [(p.upstream, p.reason) for p in router.plan(plain, {}, False, everyone_up)] == [
        ("r1", "only"),
        ("r2", "fallback"),
    ]
    plan = router.plan(plain, {}, False, lambda n: n != "r1")
    assert [p.upstream for p in plan] == ["r2", "r1"]  # whatever is up goes first


def test_a_reload_that_changes_the_policy_is_a_routing_lever_flip(tmp_path: Path) -> None:
    old = parse_config({"upstreams": UPSTREAMS, "models": {"m": {"pool": ["r1", "r2"]}},
                        "teams": TEAMS}).routes  # fmt: skip
    new = parse_config({"upstreams": UPSTREAMS, "teams": TEAMS, "models": {
        "m": {"pool": ["r1", "r2"], "routing": "prefix-affinity"}}}).routes  # fmt: skip
    assert routing_changes(old, new) == [("m", "round-robin", "prefix-affinity")]
    assert routing_changes(old, old) == []

    def write(policy: str) -> None:
        doc = {"upstreams": UPSTREAMS, "teams": TEAMS, "events_dir": str(tmp_path / "ev"),
               "models": {"m": {"pool": ["r1", "r2"], "routing": policy}}}  # fmt: skip
        path.write_text(yaml.safe_dump(doc))

    path = tmp_path / "gateway.yaml"
    write("round-robin")
    store = Store(tmp_path / "s.duckdb")
    gateway = Gateway(parse_config(yaml.safe_load(path.read_text())), path, store)
    write("least-outstanding")
    assert gateway.reload()
    assert gateway.config.routes["m"].routing == "least-outstanding"

    gateway.reloader.flush()
    with store.read() as con:
        (flip,) = con.execute("SELECT lever, before, after, note FROM lever_flips").fetchall()
    assert flip[:3] == ("routing", "round-robin", "least-outstanding")
    assert "m" in flip[3]
    gateway.events.close()
