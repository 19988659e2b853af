"""Synthetic repeats with run-level drift, for calibrating verdicts
(tests/integration/test_verdicts.py and benchmarks/bench_verdicts.py).

Each run is a seeded set of requests at two load levels, shifted as a whole by its own factors,
the drift restarts and rounds show between runs of one configuration (issue 31's A/A trial):
TTFT ±10 %, TPOT ±5 %, the request pace ±8 % (uniform). Requests vary within a run as real ones
do: lognormal TTFT, normal TPOT, 1 % failures. An `effect` multiplies the TTFT of every request
of the "after" arm (0.75: a true −25 %).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import numpy as np

from servescope.reports import bootstrap, verdict
from servescope.reports.rows import stratify
from servescope.reports.sequential import Plan, read
from servescope.store import Store

T0 = datetime(2026, 11, 26, 8, 0, 0)
LEVELS = (4, 8)
REQUESTS_PER_LEVEL = 60
DRIFT = {"ttft": 0.10, "tpot": 0.05, "pace": 0.08}
SPEC = {
    "workloads": [
        {
            "name": "chat",
            "input_tokens": 512,
            "output_tokens": 64,
            "concurrency": list(LEVELS),
            "requests_per_level": REQUESTS_PER_LEVEL,
            "seed": 0,
        }
    ]
}


@dataclass(frozen=True)
class Comparison:
    """The runs of one comparison: `before` and `after` arms, their repeats in order."""

    before: list[str]
    after: list[str]


def run_events(run_id: str, seed: int, start: datetime, ttft_effect: float = 1.0) -> list[dict]:
    """One run's events: every request shifted by the run's own drift factors."""
    rng = random.Random(seed)
    ttft_f = rng.uniform(1 - DRIFT["ttft"], 1 + DRIFT["ttft"]) * ttft_effect
    tpot_f = rng.uniform(1 - DRIFT["tpot"], 1 + DRIFT["tpot"])
    pace_f = rng.uniform(1 - DRIFT["pace"], 1 + DRIFT["pace"])
    events: list[dict[str, Any]] = []
    t = start
    for level in LEVELS:
        for _ in range(REQUESTS_PER_LEVEL):
            t += timedelta(milliseconds=rng.expovariate(1 / 60.0) * pace_f / (level / 4))
            ok = rng.random() >= 0.01
            ttft = rng.lognormvariate(5.3, 0.35) * (1 + level / 16) * ttft_f
            tpot = max(1.0, rng.gauss(30.0, 4.0) * (1 + level / 32) * tpot_f)
            event: dict[str, Any] = {
                "request_id": f"{run_id}-{len(events) + 1:06d}",
                "run_id": run_id,
                "ts": t.isoformat() + "Z",
                "model": "tiny",
                "workload": "chat",
                "concurrency": level,
                "prompt_tokens": 512,
                "status": "ok" if ok else "error",
            }
            if ok:
                event.update(
                    completion_tokens=64,
                    ttft_ms=ttft,
                    tpot_ms=tpot,
                    e2e_ms=ttft + tpot * 63,
                    finish_reason="length",
                )
            else:
                event.update(error="http_5xx", http_status=500, finish_reason="error")
            events.append(event)
    return events


def store_comparison(
    store: Store,
    name: str,
    seed: int,
    repeats: int = 3,
    ttft_effect: float = 1.0,
    start: datetime = T0,
) -> Comparison:
    """Write one comparison's runs (arms interleaved in time, A B B A …; identical levers) and
    return their ids."""
    arms: dict[str, list[str]] = {"a": [], "b": []}
    order = [arm for r in range(repeats) for arm in (("a", "b") if r % 2 == 0 else ("b", "a"))]
    with store.write() as con:  # one transaction: a store is opened once, not once a run
        for i, arm in enumerate(order):
            run_id = f"run-{name}-{arm}{len(arms[arm]) + 1}"
            arms[arm].append(run_id)
            effect = ttft_effect if arm == "b" else 1.0
            events = run_events(run_id, seed * 1000 + i, start + timedelta(minutes=5 * i), effect)
            store.add_events(events, con)
            store.upsert_run(
                run_id,
                con,
                model="tiny",
                levers={"max_num_seqs": 8},
                workload=SPEC,
                vllm_version="0.32.0",
            )
    return Comparison(before=arms["a"], after=arms["b"])


# -- the stopping rule, run after run (tests/integration/test_verdicts.py, bench_verdicts.py) --

PRIMARY, LOOK_SEED = "ttft_ms.p50", 20261122


@dataclass(frozen=True)
class Trial:
    """One simulated sequential experiment: how its primary read at the look it stopped at."""

    verdict: str
    looks: int  # repeats a side when it stopped
    estimate_pct: float


def _level_ttfts(events: list[dict]) -> list[np.ndarray]:
    """A run's TTFTs of its successful requests, sorted, one array a level (LEVELS' order)."""
    return [
        np.sort(np.array([e["ttft_ms"] for e in events
                          if e["concurrency"] == level and e["status"] == "ok"]))
        for level in LEVELS
    ]  # fmt: skip


def _run_value(levels: list[np.ndarray]) -> tuple[float, Any]:
    """The run's stratified TTFT p50 and its draws, as reports/rows.py computes them (the
    levels weighted by their requests: equal here)."""
    weights = [1.0 / len(levels)] * len(levels)
    values = [bootstrap.quantile(v, 0.5) for v in levels]
    draws = [bootstrap.quantile_draws(v, 0.5) for v in levels]
    return stratify(weights, [float(v) for v in values if v is not None], draws, log=True)


def _on_log(runs: list[tuple[float, Any]], rng: np.random.Generator) -> tuple[Any, list[Any]]:
    values = np.log([v for v, _ in runs])
    return values, [np.log(d(rng)) if d is not None else None for _, d in runs]


def sequential_trial(seed: int, ttft_effect: float = 1.0, plan: Plan | None = None) -> Trial:
    """An experiment of `store_comparison`'s runs (the same seeds, so `store_comparison(...,
    repeats=trial.looks)` stores exactly the runs it saw), looked at after every round from
    the plan's first by the stopping rule, on the path report build takes for the primary:
    each run's stratified value and request draws, Student's t with the request-noise floor,
    the rule's repeated confidence interval."""
    plan = plan or Plan()
    arms: dict[str, list[tuple[float, Any]]] = {"a": [], "b": []}
    position = 0
    reading = None
    test = None
    for repeat in range(1, plan.last + 1):
        for arm in ("a", "b") if repeat % 2 else ("b", "a"):
            effect = ttft_effect if arm == "b" else 1.0
            events = run_events("sim", seed * 1000 + position, T0, effect)
            arms[arm].append(_run_value(_level_ttfts(events)))
            position += 1
        if repeat < plan.first:
            continue
        rng = np.random.default_rng([LOOK_SEED, *PRIMARY.encode()])

        b_values, b_draws = _on_log(arms["a"], rng)
        a_values, a_draws = _on_log(arms["b"], rng)
        test = verdict.repeats_test(b_values, a_values, b_draws, a_draws)
        assert test is not None
        reading = read(test, plan, repeat, log_scale=True, before=None, better_lower=True)
        if reading.verdict != verdict.UNDECIDED:
            break
    assert reading is not None and test is not None
    return Trial(reading.verdict, repeat, float(np.expm1(test.estimate) * 100))
