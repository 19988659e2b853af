"""Bench runs against the session's real vLLM: seeded prompts, an open loop, server deltas,
Ctrl-C."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest

from servescope.loadgen.plan import unit_plan
from servescope.loadgen.prompts import PromptBook, PromptMaker
from servescope.loadgen.record import SATURATION_LAG_MS
from servescope.loadgen.workload import load_config
from servescope.store import Store, settings
from tests.helpers.cli import ROOT, SERVESCOPE, bench_args, read_events, servescope
from tests.helpers.stored import epoch
from tests.helpers.vllm import RunningServer

OPEN_LOOP = """
workloads:
  - name: poisson-probe
    prefix_tokens: 256
    input_tokens: {dist: uniform, min: 16, max: 64}
    output_tokens: 6
    rate: [4]
    arrival: poisson
    requests_per_level: 16
    warmup: 1
    team: lab
    seed: 5
"""
SLO_TTFT_MS = 5000.0


async def _bodies(url: str, name: str, scale: float, count: int) -> list[dict]:
    workload = load_config(name).workloads[0]
    async with aiohttp.ClientSession() as session:
        book = PromptBook(PromptMaker(session, url, "tiny"), workload, scale)
        return [
            await book.body(unit_plan(workload, workload.levels[0], i, scale).turns[0], "tiny")
            for i in range(count)
        ]


def test_a_seeded_workload_makes_identical_prompts_twice(vllm_server: RunningServer) -> None:
    first = asyncio.run(_bodies(vllm_server.url, "ralph-loop", 0.1, 3))
    again = asyncio.run(_bodies(vllm_server.url, "ralph-loop", 0.1, 3))
    assert first == again
    assert len({b["prompt"] for b in first}) == 3
    # one shared prefix, then each request's own diff
    prefix = first[0]["prompt"].split("\n")[0]
    assert all(b["prompt"].startswith(prefix + "\n") for b in first)
    chat = asyncio.run(_bodies(vllm_server.url, "multi-tenant-chat", 0.1, 2))
    assert chat == asyncio.run(_bodies(vllm_server.url, "multi-tenant-chat", 0.1, 2))
    assert chat[0]["messages"][0] == chat[1]["messages"][0]  # the shared system prompt


@pytest.fixture(scope="module")
def open_loop(vllm_server: RunningServer, tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("open")
    config = folder / "open.yaml"
    config.write_text(OPEN_LOOP)
    store = folder / "s.duckdb"
    runs = {}
    for run_id in ("run-20261122-open-a", "run-20261122-open-b"):
        result = servescope(
            *bench_args(config, vllm_server.url, run_id, store),
            "--slo",
            f"ttft_ms={SLO_TTFT_MS:g}",
            "--json",
        )
        assert result.returncode == 0, result.stderr
        runs[run_id] = json.loads(result.stdout)
    return {"store": Store(store), "runs": runs}


def test_open_loop_records_intended_and_actual_send_times(open_loop: dict) -> None:
    """What the level says of its schedule is what its events say. How closely the client keeps
    the schedule depends on the CPU it is given: a figure for benchmarks, not an assertion."""
    result = open_loop["runs"]["run-20261122-open-a"]
    events = read_events(Path(result["events_path"]))
    assert len(events) == 16 and all(e["status"] == "ok" for e in events)
    for event in events:
        assert event["target_rate"] == 4.0 and event["team"] == "lab"
        assert event["schedule_lag_ms"] >= 0  # never sent before its time
        assert epoch(event["ts"]) >= epoch(event["intended_ts"])
    (level,) = result["levels"]
    assert level["loop"] == "open" and level["target_rate"] == 4.0
    lags = [e["schedule_lag_ms"] for e in events]
    assert level["schedule_lag_ms"]["max"] == max(lags)
    assert min(lags) <= level["schedule_lag_ms"]["p50"] <= level["schedule_lag_ms"]["p99"]
    sends = sorted(epoch(e["ts"]) for e in events)
    assert level["achieved_rate"] == pytest.approx(15 / (sends[-1] - sends[0]), rel=0.05)
    saturated = level["schedule_lag_ms"]["p99"] > SATURATION_LAG_MS or (
        level["achieved_rate"] < 0.9 * level["scheduled_rate"]
    )
    assert level["client_saturated"] is saturated
    # goodput against the SLO, as the events say: how many meet it is the machine's business
    good = sum(e.get("ttft_ms") is None or e["ttft_ms"] <= SLO_TTFT_MS for e in events)
    assert level["good_fraction"] == good / 16
    assert level["goodput_per_s"] == pytest.approx(good / level["duration_s"])
    stored = open_loop["store"].run("run-20261122-open-a")
    assert stored["status"] == "complete"
    assert stored["notes"]["levels"][0]["achieved_rate"] == level["achieved_rate"]


def test_same_seed_same_prompts_and_schedule_across_runs(open_loop: dict) -> None:
    a, b = (
        read_events(Path(open_loop["runs"][r]["events_path"]))
        for r in ("run-20261122-open-a", "run-20261122-open-b")
    )

    def by_plan(events: list[dict]) -> dict[int, tuple[str, int]]:
        return {e["plan_index"]: (e["prompt_sha"], e["prompt_tokens"]) for e in events}

    assert by_plan(a) == by_plan(b)

    def schedule(events: list[dict]) -> list[float]:
        intended = sorted(epoch(e["intended_ts"]) for e in events)
        return [t - intended[0] for t in intended]

    # the seeded arrival times, wherever each run began
    assert schedule(a) == pytest.approx(schedule(b), abs=1e-5)
    assert len({sha for sha, _ in by_plan(a).values()}) == 16


def test_server_counters_are_scraped_and_turned_into_run_deltas(open_loop: dict) -> None:
    store: Store = open_loop["store"]
    result = open_loop["runs"]["run-20261122-open-a"]
    server, client = result["server"], result["client"]
    assert server["scrapes"] >= 3 and server["scrape_failures"] == 0
    # the server saw exactly the run's prompt tokens (warm-up excluded: it came before scraping)
    assert server["prompt_tokens"] == client["prompt_tokens"]
    assert server["generation_tokens"] == 16 * 6
    # every request shares a 256-token prefix: the server hit it, the client saw it as cached
    assert 0.5 < server["prefix_cache_hit_ratio"] <= 1
    assert server["prefix_cache_hits"] == client["cached_tokens"]
    assert server["preemptions"] == 0
    with store.read() as con:
        (samples,) = con.execute(
            "SELECT count(DISTINCT ts) FROM metric_samples WHERE run_id = ?",
            ["run-20261122-open-a"],
        ).fetchone()
    assert samples == server["scrapes"]
    notes = store.run("run-20261122-open-a")["notes"]
    assert notes["server"]["prefix_cache_hit_ratio"] == server["prefix_cache_hit_ratio"]


def test_ctrl_c_stores_what_was_measured_as_a_partial_run(
    vllm_server: RunningServer, tmp_path: Path
) -> None:
    config = tmp_path / "long.yaml"
    config.write_text(
        "workloads:\n"
        "  - {name: slow, input_tokens: 64, output_tokens: 48, concurrency: [2],"
        " requests_per_level: 400}\n"
    )
    store = tmp_path / "s.duckdb"
    events_file = settings.events_dir() / "run-20261122-ctrlc.events.jsonl"
    events_file.unlink(missing_ok=True)
    process = subprocess.Popen(
        [
            *SERVESCOPE,
            *bench_args(config, vllm_server.url, "run-20261122-ctrlc", store),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C as at a terminal: a suite started as a background job of a non-interactive
        # shell (nohup, some CI runners) hands its children SIGINT ignored, and Python keeps
        # an ignored SIGINT ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # Ctrl-C mid-run, provably: 6 requests measured, the run still going (400 requests at
    # concurrency 2 take a minute or more, so 2 are in flight at any moment)
    deadline = time.monotonic() + 600
    while not (events_file.exists() and len(events_file.read_text().splitlines()) >= 6):
        if process.poll() is not None:
            pytest.fail(f"the run ended before its 6th request:\n{process.communicate()[1]}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail("the run measured fewer than 6 requests in 600 s")
        time.sleep(0.2)
    assert process.poll() is None, "the run ended before the Ctrl-C"
    process.send_signal(signal.SIGINT)
    # it winds down: requests cancelled, a last /metrics page (tried for up to 30 s at a time on
    # a busy server), what was measured stored
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 1, stderr
    assert "interrupted" in stderr and "partial" in stderr
    run = Store(store).run("run-20261122-ctrlc")
    assert run["status"] == "partial" and run["ended_at"] is not None
    stored = Store(store).export_events("run-20261122-ctrlc")
    written = read_events(events_file)
    assert 6 <= len(stored) < 400
    assert {e["request_id"] for e in stored} == {e["request_id"] for e in written}
    assert all(e["status"] == "ok" for e in stored)
    assert run["notes"]["cancelled_in_flight"] >= 1


def _run(vllm_server: RunningServer, folder: Path, spec: str, run_id: str) -> dict:
    config = folder / f"{run_id}.yaml"
    config.write_text(spec)
    result = servescope(
        *bench_args(config, vllm_server.url, run_id, folder / "s.duckdb"),
        "--json",
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_agent_turns_quote_the_previous_real_output(
    vllm_server: RunningServer, tmp_path: Path
) -> None:
    spec = """
workloads:
  - {name: agent, endpoint: chat, prefix_tokens: 300, input_tokens: 24, output_tokens: 16,
     turns: 3, concurrency: [2], requests_per_level: 6, seed: 9}
"""
    result = _run(vllm_server, tmp_path, spec, "run-20261122-agent")
    events = read_events(Path(result["events_path"]))
    assert len(events) == 6 and all(e["status"] == "ok" for e in events)
    sessions: dict[int, list[dict]] = {}
    for event in events:
        sessions.setdefault(event["session"], []).append(event)
    assert sorted(sessions) == [0, 1]
    for turns in sessions.values():
        turns.sort(key=lambda e: e["turn"])
        assert [e["turn"] for e in turns] == [0, 1, 2]
        # each turn's prompt holds the previous prompt, its output and a new 24-token message
        grow = [
            b["prompt_tokens"] - a["prompt_tokens"] for a, b in zip(turns, turns[1:], strict=False)
        ]
        assert all(g >= 24 for g in grow), grow
        assert all(t["cached_tokens"] >= 256 for t in turns[1:])  # the conversation so far


def test_a_closed_loop_can_run_for_a_duration(vllm_server: RunningServer, tmp_path: Path) -> None:
    spec = """
workloads:
  - {name: timed, input_tokens: 32, output_tokens: 4, concurrency: [2], duration_s: 3}
"""
    result = _run(vllm_server, tmp_path, spec, "run-20261122-timed")
    (level,) = result["levels"]
    events = read_events(Path(result["events_path"]))
    # Each of the 2 workers sends until the 3 s are up, then finishes the request it has begun.
    # How many fit in 3 s, and how long the last ones run past them, is the machine's speed:
    # what is bounded is the number of requests sent after the deadline, not seconds.
    assert level["duration_s"] >= 3.0
    assert level["requests"] == result["events"] == len(events) >= 2  # one per worker at least
    sends = sorted(epoch(e["ts"]) for e in events)
    # the deadline falls at most 3 s after the first send; past it, a worker sends only the
    # request it was preparing when the deadline came: at most one per worker
    assert sum(t > sends[0] + 3.0 for t in sends) <= 2, sends
    # the level's duration covers its requests, first send to last answer (wall and monotonic
    # clocks are mixed here: 50 ms covers their drift over a few seconds)
    span = max(epoch(e["ts"]) + e["e2e_ms"] / 1000 for e in events) - sends[0]
    assert level["duration_s"] >= span - 0.05, (level["duration_s"], span)
    assert len({e["plan_index"] for e in events}) == len(events)
