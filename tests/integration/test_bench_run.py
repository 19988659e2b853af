"""`BenchRun` end to end against a stand-in OpenAI server (tests/helpers/fake_openai.py): what
its scheduler sends, what its recorder keeps (the events file, the store, the run's notes) and
what its probe learns of the server. The real vLLM's turn is tests/e2e/test_bench_run.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from servescope.loadgen.probe import TargetUnreachable
from servescope.loadgen.runner import BenchRun, LevelProgress, RunOptions, RunResult
from servescope.loadgen.workload import BenchConfig, parse_config
from servescope.store import Store
from tests.helpers.fake_openai import FakeOpenAI

WORKLOADS = """
workloads:
  - name: closed
    input_tokens: {dist: uniform, min: 8, max: 16}
    output_tokens: 4
    concurrency: [2]
    requests_per_level: 6
    warmup: 1
    seed: 3
    classes:
      - {name: short, weight: 1, input_tokens: 8, output_tokens: 3}
      - {name: long, weight: 1, input_tokens: 20, output_tokens: 5}
  - name: open
    input_tokens: 10
    output_tokens: 3
    rate: [50]
    arrival: poisson
    requests_per_level: 8
    seed: 4
  - name: agent
    endpoint: chat
    input_tokens: 10
    output_tokens: 3
    turns: 3
    concurrency: [1]
    requests_per_level: 6
    seed: 5
"""


def _config(text: str = WORKLOADS) -> BenchConfig:
    return parse_config(yaml.safe_load(text))


def _run(
    server: FakeOpenAI | None, store: Store, tmp_path: Path, config: BenchConfig, **options: Any
) -> tuple[RunResult, list[dict[str, Any]], FakeOpenAI]:
    """The run against a fresh stand-in (or `server`'s settings), and the events it sent."""
    seen: list[dict[str, Any]] = []

    async def main() -> tuple[RunResult, FakeOpenAI]:
        async with server or FakeOpenAI() as fake:
            run = BenchRun(
                config,
                fake.url,
                store=store,
                options=RunOptions(run_id="r1", events_dir=tmp_path, **options),
                progress=LevelProgress(on_request=lambda e: seen.append(dict(e))),
            )
            return await run.run(), fake

    result, fake = asyncio.run(main())
    return result, seen, fake


def test_a_run_sends_each_level_and_keeps_every_answer_once(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    result, seen, fake = _run(None, store, tmp_path, _config(), slo={"ttft_ms": 10_000.0})
    assert result.status == "complete" and result.errors == 0
    # 6 closed + 8 open + 2 agent sessions of 3 turns, each recorded once, in send order ids
    assert result.events == len(seen) == 6 + 8 + 2 * 3
    ids = sorted(e["request_id"] for e in seen)
    assert ids == [f"r1-{i:06d}" for i in range(1, result.events + 1)]
    # the warm-up went out too, under an id of no run
    assert len(fake.bodies) == result.events + 1
    assert not fake.request_ids[0].startswith("r1-")
    lines = [json.loads(line) for line in (tmp_path / "r1.events.jsonl").read_text().splitlines()]
    assert sorted(e["request_id"] for e in lines) == ids
    with store.read() as con:
        stored = con.execute("SELECT count(*) FROM events WHERE run_id = 'r1'").fetchone()
    assert stored == (result.events,)


def test_the_levels_report_their_load_loop_and_classes(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    result, seen, _fake = _run(None, store, tmp_path, _config(), slo={"ttft_ms": 10_000.0})
    closed, opened, agent = result.levels
    assert (closed["loop"], closed["concurrency"], closed["requests"]) == ("closed", 2, 6)
    assert set(closed.get("classes", {})) == {"short", "long"}
    assert sum(c["requests"] for c in closed.get("classes", {}).values()) == 6
    assert (opened["loop"], opened["target_rate"], opened["requests"]) == ("open", 50, 8)
    assert opened.get("scheduled_rate") and "p99" in opened.get("schedule_lag_ms", {})
    assert all("schedule_lag_ms" in e for e in seen if e["workload"] == "open")
    assert agent["requests"] == 6 and agent.get("good_fraction") == 1.0
    assert result.client is not None and result.client["good_fraction"] == 1.0
    assert result.client["cached_tokens"] == 3 * result.events


def test_an_agent_turn_quotes_the_answer_before_it(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    _result, seen, fake = _run(None, store, tmp_path, _config())
    agent = [e for e in seen if e["workload"] == "agent"]
    assert sorted((e["session"], e["turn"]) for e in agent) == [
        (s, t) for s in (0, 1) for t in (0, 1, 2)
    ]
    chats = [b["messages"] for b in fake.bodies if "messages" in b]
    last = max(chats, key=len)
    roles = [m["role"] for m in last]
    assert roles.count("assistant") == 2 and roles[-1] == "user"
    assert all(m["content"].startswith("t0 ") for m in last if m["role"] == "assistant")
    assert "output_text" not in agent[0]  # kept for the next turn, never stored


def test_the_notes_hold_the_client_the_server_and_the_callers_own(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    result, _seen, _fake = _run(None, store, tmp_path, _config(), notes={"experiment": "e"})
    notes = store.run("r1")["notes"]
    assert notes["experiment"] == "e"
    assert notes["levels"] == json.loads(json.dumps(result.levels))
    assert notes["client"]["requests"] == result.events
    assert notes["server"]["scrapes"] >= 3  # the first page, one per level end, the last
    assert notes["server"]["prefix_cache_hit_ratio"] == pytest.approx(0.3)
    assert notes["events_file"].endswith("r1.events.jsonl")


def test_a_tight_slo_counts_no_request_good(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    result, _seen, _fake = _run(None, store, tmp_path, _config(), slo={"ttft_ms": 0.000_001})
    assert result.client is not None
    assert (result.client["good_requests"], result.client["good_fraction"]) == (0, 0.0)


def test_failed_requests_are_counted_by_class(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    config = _config(
        "workloads:\n  - {name: w, input_tokens: 8, output_tokens: 2, concurrency: [1],"
        " requests_per_level: 6, warmup: 0}\n"
    )
    result, _seen, _fake = _run(FakeOpenAI(fail_every=3), store, tmp_path, config)
    assert (result.events, result.errors, result.error_classes) == (6, 2, {"http_5xx": 2})


def test_a_target_that_does_not_answer_measures_nothing(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    run = BenchRun(
        _config(),
        "http://127.0.0.1:9",
        store=store,
        options=RunOptions(run_id="r1", events_dir=tmp_path),
    )
    with pytest.raises(TargetUnreachable):
        asyncio.run(run.run())
    assert not store.has_run("r1")
