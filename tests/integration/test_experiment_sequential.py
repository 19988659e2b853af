"""Sequential experiments without a vLLM: rounds until the stopping rule decides (the real rule
on the real store, runs written by a fake bench), at the plan's last round, or when the budget
would not fit another; runs that grow when their requests make most of their noise; and what
the runs and the pooled report say about why the experiment stopped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from servescope.commands import experiment as command
from servescope.loadgen.experiment import Experiment
from servescope.loadgen.rounds import MAX_GROWTH, Look, Stopping
from servescope.loadgen.sequence import ExperimentHooks
from servescope.loadgen.spec import load_experiments
from servescope.reports import build_diff
from servescope.store import Store
from tests.helpers.experiments import FakeBench


def _experiment(store: Store, tmp_path: Path, stopping: Stopping, judge: Any = None,
                name: str = "prefix-caching") -> tuple[Experiment, FakeBench]:  # fmt: skip
    bench = FakeBench(store)
    hooks = command.hooks(store, stopping)
    hooks = ExperimentHooks(judge=judge or hooks.judge)
    spec = load_experiments()[name]
    exp = Experiment(spec, store=store, execute=bench, model=tmp_path, hooks=hooks,
                     stopping=stopping)  # fmt: skip
    return exp, bench


@pytest.mark.usefixtures("fake_servers")  # VllmServer replaced by FakeServer
def test_a_clear_effect_stops_at_the_first_look_and_the_report_says_why(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    stopping = Stopping(3, 8, None, 10.0)
    exp, _bench = _experiment(store, tmp_path, stopping)
    result = exp.run()
    assert result.status == "complete", result.failure
    assert result.stopped == "decided" and len(result.runs) == 6
    assert result.order == "A B B A A B"
    assert result.stop_words == "decided after 3 repeats a side"
    (look,) = result.looks
    assert look.decided and "improved" in look.words[0]
    notes = store.run(result.runs[0].run_id)["notes"]
    assert notes["plan"] == {"first": 3, "last": 8, "margin_pct": 10.0, "budget_s": None}
    reports = command.report(store, result, tmp_path / "out", stopping)
    (pooled,) = reports.pooled
    decision = pooled.report["decision"]
    assert decision["stopped"] == "decided" and decision["verdict"] == "improved"
    assert decision["reason"] == "decided after 3 repeats a side"
    assert decision["plan"] == [3, 8] and decision["look"] == 3
    # the stored runs, reported later, read with the plan the runs recorded
    again = build_diff(store, pooled.after, pooled.before)["decision"]
    assert again["plan"] == [3, 8] and again["verdict"] == "improved" and again["stopped"] is None


@pytest.mark.usefixtures("fake_servers")  # VllmServer replaced by FakeServer
def test_an_undecided_experiment_runs_to_the_plans_last_round(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    looks: list[int] = []

    def never(result: Any) -> Look:
        looks.append(len(result.runs))
        return Look(False, ["a → b: undecided"], None)

    exp, _bench = _experiment(store, tmp_path, Stopping(3, 5, None, 10.0), never)
    result = exp.run()
    assert result.stopped == "max repeats" and len(result.runs) == 10
    assert looks == [6, 8, 10]  # after rounds 3, 4 and 5
    assert result.stop_words == "the plan's 5 repeats a side were run (--max-repeats)"


@pytest.mark.usefixtures("fake_servers")  # VllmServer replaced by FakeServer
def test_the_budget_starts_no_round_that_would_end_after_it(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    exp, _bench = _experiment(store, tmp_path, Stopping(3, 10, 0.001, 10.0))
    result = exp.run()
    assert result.stopped == "budget" and len(result.runs) == 2  # one round, then no time
    assert result.stop_words.startswith("the time budget (0 s) would not fit another round")
    reports = command.report(store, result, tmp_path / "out", exp.stopping)
    decision = reports.pooled[0].report["decision"]
    assert decision["stopped"] == "budget" and decision["reason"] == result.stop_words
    assert "one run a side: request noise only" in decision["words"]


@pytest.mark.usefixtures("fake_servers")  # VllmServer replaced by FakeServer
def test_runs_grow_when_their_requests_make_most_of_their_noise(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    exp, bench = _experiment(store, tmp_path, Stopping(3, 4, None, 10.0),
                             lambda _result: Look(False, ["undecided"], 0.95))  # fmt: skip
    first = exp.config.workloads[0].requests_per_level
    result = exp.run()
    assert len(result.runs) == 8
    sent = [options.notes["repeat"] for _target, options in bench.calls]
    assert sent == [1, 1, 2, 2, 3, 3, 4, 4]
    assert exp.config.workloads[0].requests_per_level == first * MAX_GROWTH
    assert result.sizing is not None and "95 %" in result.sizing and "×4" in result.sizing
