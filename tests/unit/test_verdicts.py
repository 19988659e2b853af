"""Verdicts calibrated on repeats: synthetic A/A comparisons with run-level drift (nothing
changed) must come out without a verdict, and a true −25 % TTFT must be found, through the
command a CI step types (`report build A1 A2 A3 --vs B1 B2 B3 --fail-on regressed --json`).

The runs are written to a real DuckDB store (tests/calibration.py: TTFT ±10 %, TPOT ±5 %, pace
±8 % per run, two load levels, 1 % failures); the reports are built by the CLI's own entry point.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from servescope import cli
from servescope.reports import verdict
from servescope.store import Store
from tests.calibration import Comparison, store_comparison
from tests.integration.test_report import markdown_text

A_A = 20
EFFECTS = 5


def report_build(
    capsys: pytest.CaptureFixture[str], db: Path, out: Path, *args: str
) -> tuple[int, dict[str, Any]]:
    """`report build … --json` as typed, in this process (the console script's own `main`)."""
    code = cli.main(["report", "build", *args, "--store", str(db), "--out", str(out), "--json"])
    printed = capsys.readouterr().out.strip().splitlines()
    return code, json.loads(printed[-1]) if printed else {}


def arms(c: Comparison, reverse: bool = False) -> list[str]:
    after, before = (c.before, c.after) if reverse else (c.after, c.before)
    return [*after, "--vs", *before]


@pytest.fixture(scope="module")
def calibration(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("calibration")
    db = folder / "s.duckdb"
    store = Store(db)
    aa = [store_comparison(store, f"aa{i}", seed=i) for i in range(A_A)]
    effect = [
        store_comparison(store, f"fx{i}", seed=100 + i, ttft_effect=0.75) for i in range(EFFECTS)
    ]
    return {"db": db, "out": folder / "reports", "aa": aa, "effect": effect}


def test_a_a_comparisons_show_no_verdict_and_pass_the_gate(
    calibration: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    quiet, passed = 0, 0
    for c in calibration["aa"]:
        code, brief = report_build(
            capsys, calibration["db"], calibration["out"], *arms(c), "--fail-on", "regressed",
            "--format", "json",
        )  # fmt: skip
        assert code in (0, 3), brief
        assert brief["repeats"]["before"] == brief["repeats"]["after"] == 3
        verdicts = set(brief["verdicts"].values())
        quiet += not verdicts & {"improved", "regressed"}
        passed += code == 0
        assert (code == 3) == bool(brief["fail_on"]["rows"])
    assert quiet >= 17, f"{A_A - quiet} of {A_A} A/A comparisons got a verdict"
    assert passed >= 17, f"--fail-on regressed failed {A_A - passed} of {A_A} A/A comparisons"


def test_a_true_effect_is_found_and_a_reversed_one_fails_the_gate(
    calibration: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    found = 0
    for c in calibration["effect"]:
        code, brief = report_build(
            capsys, calibration["db"], calibration["out"], *arms(c), "--format", "json"
        )
        assert code == 0
        level = brief["primary"]["level"]
        assert brief["primary"]["metric"] == "ttft_ms.p50"
        found += brief["verdicts"][f"ttft_ms.p50@{level}"] == "improved"
    assert found >= 4, f"a true −25 % TTFT found in {found} of {EFFECTS}"

    c = calibration["effect"][0]
    code, brief = report_build(
        capsys, calibration["db"], calibration["out"], *arms(c, reverse=True),
        "--fail-on", "regressed", "--format", "json",
    )  # fmt: skip
    assert code == 3
    failing = brief["fail_on"]["rows"]
    assert brief["fail_on"]["exit"] == 3
    assert any(r["metric"] == "ttft_ms.p50" and r["verdict"] == "regressed" for r in failing)
    assert all(r["p_adjusted"] <= 0.05 for r in failing)  # the primary at 5 %, the rest 2.5 %


def test_one_run_a_side_says_it_covers_request_noise_only(
    calibration: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    c = calibration["aa"][0]
    out = calibration["out"]
    code, brief = report_build(capsys, calibration["db"], out, c.after[0], "--vs", c.before[0])
    assert code == 0
    assert "one run a side: request noise only" in brief["headline"]
    folder = out / f"{c.after[0]}-vs-{c.before[0]}"
    report = json.loads((folder / "report.json").read_text())
    assert report["repeats"]["note"] == verdict.REQUEST_NOISE_ONLY
    tested = [d for d in report["diff"] if d["test"]]
    assert tested and all(d["test"]["covers"] == "request noise only" for d in tested)
    md = markdown_text((folder / "report.md").read_text())
    html = (folder / "index.html").read_text()
    for text in (md, html):
        assert "the interval covers request-to-request noise only" in text
        assert "[request noise only]" in text  # next to each verdict
        assert "run-to-run variation is unknown" in text


def test_primary_overrides_the_lever_s_indicator(
    calibration: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    c = calibration["effect"][2]
    code, brief = report_build(
        capsys, calibration["db"], calibration["out"], *arms(c), "--primary", "tpot_ms.p50",
        "--format", "json",
    )  # fmt: skip
    assert code == 0 and brief["primary"]["metric"] == "tpot_ms.p50"
    assert "concurrency 4): TPOT p50 " in brief["headline"]


def test_student_t_matches_the_tables() -> None:
    # two-sided 95 % critical values of Student's t (any statistics table)
    for df, value in ((1, 12.706), (2, 4.303), (4, 2.776), (10, 2.228), (30, 2.042)):
        assert verdict.t_critical(df) == pytest.approx(value, abs=1e-3)
    assert verdict.t_critical(None) == pytest.approx(1.960, abs=1e-3)
    assert verdict.two_sided_p(2.776, 4) == pytest.approx(0.05, abs=1e-3)


def test_holm_steps_down() -> None:
    assert verdict.holm([0.01, 0.04, 0.03]) == [True, False, False]  # 0.01 ≤ .05/3; 0.03 > .05/2
    assert verdict.holm([0.01, 0.02, 0.04]) == [True, True, True]
    assert verdict.holm_adjusted([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])


def test_repeats_test_uses_the_runs_spread_and_the_request_floor() -> None:
    before, after = [0.0, 0.1, -0.1], [0.5, 0.6, 0.4]
    test = verdict.repeats_test(before, after)
    assert test is not None and test.df == 4 and test.estimate == pytest.approx(0.5)
    assert test.error == pytest.approx(0.1 * math.sqrt(2 / 3))
    # runs agreeing more closely than their requests allow: the request noise is the error
    wide = [pytest.importorskip("numpy").random.default_rng(0).normal(0, 1, 4000)] * 3
    floored = verdict.repeats_test(before, after, wide, wide)
    assert floored is not None and floored.df == 4  # still Student's critical value
    assert floored.error == pytest.approx(math.sqrt(2 / 3), rel=0.05)
    assert verdict.repeats_test([1.0], [2.0]) is None  # one run a side: nothing to estimate
    needed = [verdict.repeats_needed(0.1, change) for change in (0.05, 0.1, 0.3)]
    assert needed[0] is None and needed[1] > needed[2] >= 2
