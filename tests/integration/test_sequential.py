"""The stopping rule calibrated: simulated experiments that look at their evidence after every
round (tests/helpers/calibration.py: runs drifting as real ones do, TTFT ±10 %, TPOT ±5 %, pace
±8 % a run) must keep their false alarms at 5 % however many looks they take, and find a true effect
within the default plan (at most 10 repeats a side).

The looks run the primary's own path (each run's stratified TTFT p50 and its request draws,
Student's t with the request-noise floor, the rule's repeated interval); every A/A experiment
is then built as `report build` builds it, at the look it stopped at, and the whole report (the
primary and the family of every other row) is checked, as is the primary's agreement with the
fast path.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from servescope.reports import ReportOptions, build_diff
from servescope.reports.sequential import Plan
from servescope.store import Store
from tests.helpers.calibration import sequential_trial, store_comparison
from tests.helpers.cli import servescope

A_A, EFFECTS = 200, 50
CHANGES = {"improved", "regressed"}
# The whole reports are built at looks of at most 10 a side (a report of 20 runs a side takes
# twice as long); the default plan (up to 20) is held to the same on the primary's path.
TEN = Plan(last=10)


@pytest.mark.parametrize(
    "half", [pytest.param(h, marks=pytest.mark.xdist_group(f"sequential A/A {h}")) for h in (0, 1)]
)
def test_a_a_experiments_end_with_a_verdict_at_most_5_percent_of_the_time(
    tmp_path: Path, half: int
) -> None:
    """200 A/A experiments in two halves of 100 (the two halves run side by side), each held
    to 5 %: at most 10 of the 200 with a verdict anywhere."""
    store = Store(tmp_path / "s.duckdb")
    any_row, primary, stopped_early = 0, 0, 0
    for seed in range(half * A_A // 2, (half + 1) * A_A // 2):
        trial = sequential_trial(seed, plan=TEN)
        c = store_comparison(store, f"aa{seed}", seed, repeats=trial.looks)
        report = build_diff(store, c.after, c.before, ReportOptions(charts=False, plan=TEN))
        assert report["decision"]["verdict"] == trial.verdict, seed  # one path, two callers
        assert report["decision"]["look"] == trial.looks
        any_row += any(row["verdict"] in CHANGES for row in report["diff"])
        primary += trial.verdict in CHANGES
        stopped_early += trial.looks < 10
    assert any_row <= A_A // 2 * 0.05, f"{any_row} of {A_A // 2} A/A experiments got a verdict"
    assert primary <= any_row
    assert stopped_early > 0  # some decided "unchanged within ±10 %" before the last look


def test_the_default_plan_keeps_its_primary_to_5_percent() -> None:
    trials = [sequential_trial(seed) for seed in range(A_A)]
    called = sum(t.verdict in CHANGES for t in trials)
    assert called <= A_A * 0.05, f"{called} of {A_A} A/A experiments called a change"
    assert max(t.looks for t in trials) <= Plan().last


def test_a_true_25_percent_is_found_within_the_default_plan() -> None:
    trials = [sequential_trial(1000 + seed, ttft_effect=0.75) for seed in range(EFFECTS)]
    found = sum(t.verdict == "improved" for t in trials)
    assert found >= EFFECTS * 0.9, f"a true −25 % TTFT found in {found} of {EFFECTS}"
    assert max(t.looks for t in trials) <= Plan().last
    assert sum(t.looks for t in trials) / EFFECTS < 5  # it stops as soon as it can


def test_a_true_10_percent_says_how_many_repeats_it_took(tmp_path: Path) -> None:
    trials = [sequential_trial(2000 + seed, ttft_effect=0.9) for seed in range(EFFECTS)]
    found = [t for t in trials if t.verdict == "improved"]
    assert len(found) >= EFFECTS * 0.5, f"a true −10 % TTFT found in {len(found)} of {EFFECTS}"
    assert not [t for t in trials if t.verdict == "regressed"]
    slow = max(found, key=lambda t: t.looks)
    store = Store(tmp_path / "s.duckdb")
    c = store_comparison(store, "slow", trials.index(slow) + 2000, repeats=slow.looks,
                         ttft_effect=0.9)  # fmt: skip
    decision = build_diff(store, c.after, c.before)["decision"]
    assert decision["verdict"] == "improved"
    assert f"{slow.looks} repeats a side" in decision["words"]
    assert decision["reason"] == f"stored runs, read as a look of {slow.looks} repeats a side"


def test_report_build_reads_stored_runs_by_the_same_rule_with_its_margin(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    c = store_comparison(store, "stored", 7, repeats=5)
    out = tmp_path / "out"
    decisions = {}
    for margin in ("40", "0.5"):
        servescope(
            "report", "build", *c.after, "--vs", *c.before, "--margin", margin,
            "--store", str(store.path), "--out", str(out / margin), "--format", "json",
            check=True,
        )  # fmt: skip
        (found,) = (out / margin).glob("*/report.json")
        decisions[margin] = json.loads(found.read_text())["decision"]
    wide, narrow = decisions["40"], decisions["0.5"]
    assert wide["verdict"] == "unchanged" and "unchanged within ±40 %" in wide["words"]
    assert narrow["verdict"] == "undecided" and narrow["margin_pct"] == 0.5
    assert "neither excludes no change nor lies within ±0.5 %" in narrow["words"]
    assert narrow["more_repeats"] is None or narrow["more_repeats"] > 0
    assert wide["stopped"] is None
    assert wide["reason"] == "stored runs, read as a look of 5 repeats a side"
    bad = servescope("report", "build", *c.after, "--vs", *c.before, "--margin", "100",
                     "--store", str(store.path))  # fmt: skip
    assert bad.returncode == 2 and "--margin is a percentage" in bad.stdout + bad.stderr
    assert "Traceback" not in bad.stderr
