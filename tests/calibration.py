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
