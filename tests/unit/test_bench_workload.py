"""Workload files, plans and arrival schedules: no server needed, every rule checked on values."""

from __future__ import annotations

import statistics

import pytest
import yaml

from servescope.loadgen.launcher import load_profiles
from servescope.loadgen.plan import (
    open_loop_units,
    prefix_size,
    unit_plan,
    units_per_level,
    warmup_units,
)
from servescope.loadgen.record import meets_slo
from servescope.loadgen.sequence import lever_flips
from servescope.loadgen.spec import load_experiments
from servescope.loadgen.workload import WorkloadError, load_config, parse_config, shipped
from servescope.wire.routing import ROUTING_POLICIES
from servescope.wire.slo import parse_slo

SEED_FILE = """
workloads:
  - {name: short-short, input_tokens: 128, output_tokens: 64, concurrency: [1, 4, 8, 16]}
  - {name: long-short, input_tokens: 4096, output_tokens: 64, concurrency: [1, 4, 8]}
metrics: [ttft_ms, tpot_ms, qps, tokens_per_second, memory_peak_gb]
"""


def test_the_seed_file_reads_verbatim() -> None:
    config = parse_config(yaml.safe_load(SEED_FILE))
    assert [w.name for w in config.workloads] == ["short-short", "long-short"]
    short = config.workloads[0]
    assert short.levels == [1, 4, 8, 16] and not short.open_loop
    assert unit_plan(short, 1, 0, 1.0).turns[0].input_tokens == 128
    assert config.metrics == ["ttft_ms", "tpot_ms", "qps", "tokens_per_second", "memory_peak_gb"]


def test_every_shipped_scenario_loads() -> None:
    names = set(shipped())
    assert {
        "seed-lab10",
        "ralph-loop",
        "multi-tenant-chat",
        "rag",
        "codebase-analysis",
        "mixed-long-short",
        "agent",
    } <= names
    for name in names:
        assert load_config(name).workloads
    ralph = load_config("ralph-loop").workloads[0]
    assert 3000 <= prefix_size(ralph, 1.0) <= 8000
    assert prefix_size(load_config("codebase-analysis").workloads[0], 1.0) >= 10_000
    assert load_config("agent").workloads[0].turns > 1


def test_same_seed_same_requests_and_schedule() -> None:
    spec = {
        "workloads": [
            {
                "name": "w",
                "input_tokens": {"dist": "lognormal", "mean": 300, "std": 200, "max": 2000},
                "output_tokens": {"dist": "uniform", "min": 8, "max": 64},
                "rate": [2.0],
                "arrival": "gamma",
                "burstiness": 0.5,
                "requests_per_level": 50,
                "seed": 3,
            }
        ]
    }
    first = open_loop_units(parse_config(spec).workloads[0], 2.0, 1.0)
    again = open_loop_units(parse_config(spec).workloads[0], 2.0, 1.0)
    assert first == again
    spec["workloads"][0]["seed"] = 4
    other = open_loop_units(parse_config(spec).workloads[0], 2.0, 1.0)
    assert [u.offset_s for u in other] != [u.offset_s for u in first]
    sizes = [u.turns[0].input_tokens for u in first]
    assert len(set(sizes)) > 10 and max(sizes) <= 2000
    assert all(8 <= u.turns[0].output_tokens <= 64 for u in first)


@pytest.mark.parametrize("arrival", ["constant", "poisson", "gamma"])
def test_arrivals_have_the_target_mean_rate(arrival: str) -> None:
    workload = parse_config(
        {
            "workloads": [
                {
                    "name": "w",
                    "input_tokens": 8,
                    "output_tokens": 8,
                    "rate": [5],
                    "arrival": arrival,
                    "burstiness": 0.25,
                    "requests_per_level": 4000,
                }
            ]
        }
    ).workloads[0]
    offsets = [u.offset_s or 0.0 for u in open_loop_units(workload, 5.0, 1.0)]
    gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    assert offsets[0] == 0.0
    assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.08)
    cv = statistics.pstdev(gaps) / statistics.mean(gaps)
    # coefficient of variation: 0 constant, 1 Poisson, 1/sqrt(shape) = 2 for gamma shape 0.25
    assert cv == pytest.approx({"constant": 0.0, "poisson": 1.0, "gamma": 2.0}[arrival], abs=0.15)


def test_duration_bounds_an_open_loop_and_scale_shrinks_prompts() -> None:
    workload = parse_config(
        {
            "workloads": [
                {
                    "name": "w",
                    "prefix_tokens": 6000,
                    "input_tokens": 200,
                    "output_tokens": 8,
                    "rate": [10],
                    "arrival": "constant",
                    "duration_s": 3,
                }
            ]
        }
    ).workloads[0]
    units = open_loop_units(workload, 10.0, 0.5)
    assert len(units) == 30 and max(u.offset_s or 0 for u in units) < 3
    assert prefix_size(workload, 0.5) == 3000
    assert units[0].turns[0].input_tokens == 100


def test_classes_and_agent_sessions() -> None:
    mixed = load_config("mixed-long-short").workloads[0]
    classes = [unit_plan(mixed, 1, i, 1.0).turns[0].request_class for i in range(400)]
    assert set(classes) == {"long", "probe"}
    assert classes.count("probe") / len(classes) == pytest.approx(0.75, abs=0.07)
    agent = load_config("agent").workloads[0]
    unit = unit_plan(agent, 1, 2, 1.0)
    assert [p.turn for p in unit.turns] == list(range(agent.turns))
    assert units_per_level(agent) * agent.turns >= agent.requests_per_level
    warm = warmup_units(agent, 1.0)
    assert len(warm) == agent.warmup and warm[0].turns[0].text_seed != unit.turns[0].text_seed


@pytest.mark.parametrize(
    ("workload", "message"),
    [
        ({"name": "w", "input_tokens": 8, "output_tokens": 8}, "either `concurrency`"),
        (
            {"name": "w", "input_tokens": 8, "output_tokens": 8, "concurrency": [1], "rate": [1]},
            "not both",
        ),
        ({"name": "w", "input_tokens": 0, "output_tokens": 8, "concurrency": [1]}, "≥ 1, got 0"),
        (
            {"name": "w", "input_tokens": {"dist": "zipf"}, "output_tokens": 8, "rate": [1]},
            "dist",
        ),
        (
            {"name": "w", "input_tokens": 8, "output_tokens": 8, "rate": [1], "arrival": "x"},
            "arrival",
        ),
        ({"name": "w", "input_tokens": 8, "output_tokens": 8, "concurrency": [1], "x": 1}, "x"),
    ],
)
def test_bad_workloads_say_what_is_wrong(workload: dict, message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        parse_config({"workloads": [workload]})


def test_slo_and_goodput_rule() -> None:
    slo = parse_slo("ttft_ms=500,tpot_ms=50")
    assert slo == {"ttft_ms": 500.0, "tpot_ms": 50.0}
    assert meets_slo({"status": "ok", "ttft_ms": 499, "tpot_ms": 50}, slo)
    assert not meets_slo({"status": "ok", "ttft_ms": 501, "tpot_ms": 1}, slo)
    assert not meets_slo({"status": "error", "ttft_ms": 1}, slo)


def test_experiments_flip_one_lever_between_known_profiles() -> None:
    profiles = load_profiles()
    experiments = load_experiments()
    assert {"prefix-caching", "chunked-prefill", "max-num-seqs"} <= set(experiments)
    for spec in experiments.values():
        if spec.fleet is None:
            assert set(spec.profiles) <= set(profiles)
        else:  # a fleet's profiles are the gateway's routing policies, its replicas one profile
            assert set(spec.profiles) <= set(ROUTING_POLICIES)
            assert spec.fleet.profile in profiles
        load_config(spec.workload)
    assert lever_flips({"a": 1, "enable_prefix_caching": False}, {"a": 1}) == [
        ("enable_prefix_caching", "False", "default")
    ]
