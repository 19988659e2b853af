"""Synthetic runs for the report tests: lognormal TTFTs with a known divisor between two runs,
stored as a user would store them."""

from __future__ import annotations

import random
from datetime import datetime, timedelta
from typing import Any

from servescope.store import Store

T0 = datetime(2026, 11, 22, 4, 0, 0)
SPEC = {
    "workloads": [
        {
            "name": "short-short",
            "input_tokens": 512,
            "output_tokens": 32,
            "concurrency": [4, 8],
            "requests_per_level": 200,
            "seed": 0,
        }
    ]
}
N = 400


def synthetic_events(
    run_id: str, *, seed: int, ttft_divisor: float, start: datetime, n: int = N
) -> list[dict[str, Any]]:
    """TTFT lognormal ÷ `ttft_divisor`; TPOT always from the same normal distribution."""
    rng = random.Random(seed)
    events = []
    for i in range(n):
        ttft = rng.lognormvariate(5.3, 0.4) / ttft_divisor
        tpot = rng.gauss(30.0, 5.0)
        events.append(
            {
                "request_id": f"{run_id}-{i + 1:06d}",
                "run_id": run_id,
                "ts": (start + timedelta(milliseconds=50 * i)).isoformat() + "Z",
                "model": "tiny",
                "workload": "short-short",
                "concurrency": 4 if i < n // 2 else 8,
                "prompt_tokens": 512,
                "completion_tokens": 32,
                "ttft_ms": ttft,
                "tpot_ms": tpot,
                "e2e_ms": ttft + tpot * 31,
                "status": "ok",
                "finish_reason": "length",
            }
        )
    return events


def store_run(
    store: Store,
    run_id: str,
    events: list[dict[str, Any]],
    *,
    levers: dict[str, Any],
    spec: dict[str, Any] | None = SPEC,
) -> None:
    store.add_events(events)
    store.upsert_run(run_id, model="tiny", levers=levers, workload=spec, vllm_version="0.32.0")
