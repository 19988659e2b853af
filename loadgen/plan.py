"""What a workload level will send, decided before anything is sent: request sizes and classes,
agent sessions, and the arrival schedule of an open loop.

Plans are pure functions of the workload, the level and the request index (no server, no clock),
so the same seed gives the same requests and the same schedule on every run, and a level that
runs for a duration can draw request N without drawing 0…N-1 again.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from servescope.loadgen.workload import Workload, sample

WARMUP_LEVEL = "warmup"


def rng_for(workload: Workload, level: object, *parts: object) -> random.Random:
    """A generator seeded by the workload's seed and name, the level and `parts`."""
    key = ":".join(str(p) for p in (workload.seed, workload.name, level, *parts))
    return random.Random(key)


@dataclass(frozen=True)
class RequestPlan:
    """One request: its sizes, its class, and the seed its prompt text is drawn from."""

    index: int
    input_tokens: int
    output_tokens: int
    request_class: str | None
    text_seed: str
    turn: int = 0


@dataclass(frozen=True)
class Unit:
    """What one closed-loop worker (or one open-loop arrival) sends: one request, or an agent
    session's turns in order (each turn's prompt holds the previous turns' real outputs)."""

    index: int
    turns: tuple[RequestPlan, ...]
    offset_s: float | None = None


def request_plan(workload: Workload, level: object, index: int, scale: float) -> RequestPlan:
    rng = rng_for(workload, level, index, "size")
    if workload.classes:
        cls = rng.choices(workload.classes, weights=[c.weight for c in workload.classes])[0]
        name, input_tokens, output_tokens = cls.name, cls.input_tokens, cls.output_tokens
    else:
        name, input_tokens, output_tokens = None, workload.input_tokens, workload.output_tokens
    return RequestPlan(
        index=index,
        input_tokens=sample(input_tokens, rng, scale),
        output_tokens=sample(output_tokens, rng, 1.0),
        request_class=name,
        text_seed=f"{workload.seed}:{workload.name}:{level}:{index}:text",
    )


def unit_plan(workload: Workload, level: object, index: int, scale: float) -> Unit:
    first = index * workload.turns
    turns = tuple(
        _with_turn(request_plan(workload, level, first + t, scale), t)
        for t in range(workload.turns)
    )
    return Unit(index=index, turns=turns)


def _with_turn(plan: RequestPlan, turn: int) -> RequestPlan:
    return RequestPlan(**{**plan.__dict__, "turn": turn})


def prefix_size(workload: Workload, scale: float) -> int:
    """The shared static prefix's token count: one draw per workload (0 when there is none)."""
    if workload.prefix_tokens is None:
        return 0
    return sample(workload.prefix_tokens, rng_for(workload, "prefix", "size"), scale)


def units_per_level(workload: Workload) -> int:
    """Units (requests, or agent sessions) of a level run by count."""
    return -(-workload.requests_per_level // workload.turns)


def arrival_gaps(workload: Workload, rate: float) -> Iterator[float]:
    """Seconds between successive arrivals: constant, Poisson, or gamma with shape
    `burstiness` (< 1 burstier than Poisson, > 1 more regular), mean 1/rate in every case
    (the same arrival model as `vllm bench serve --burstiness`)."""
    rng = rng_for(workload, rate, "arrivals")
    while True:
        if workload.arrival == "constant":
            yield 1.0 / rate
        elif workload.arrival == "poisson":
            yield rng.expovariate(rate)
        else:
            shape = workload.burstiness
            yield rng.gammavariate(shape, 1.0 / (rate * shape))


def open_loop_units(workload: Workload, rate: float, scale: float) -> list[Unit]:
    """Units of an open-loop level with their intended send offsets (the first at 0 s); by
    count, or every arrival before `duration_s`."""
    units: list[Unit] = []
    offset = 0.0
    gaps = arrival_gaps(workload, rate)
    while True:
        if workload.duration_s is None and len(units) >= units_per_level(workload):
            break
        if workload.duration_s is not None and offset >= workload.duration_s:
            break
        unit = unit_plan(workload, rate, len(units), scale)
        units.append(Unit(unit.index, unit.turns, offset))
        offset += next(gaps)
    return units


def warmup_units(workload: Workload, scale: float) -> list[Unit]:
    """Warm-up requests: same shapes as the workload (same prefix), their own seeds."""
    return [unit_plan(workload, WARMUP_LEVEL, i, scale) for i in range(workload.warmup)]
