"""Verdicts calibrated on repeats: synthetic A/A comparisons with run-level drift (nothing
changed) must come out without a verdict, and a true −25 % TTFT must be found, through the
command a CI step types (`report build A1 A2 A3 --vs B1 B2 B3 --fail-on regressed --json`).

The runs are written to a real DuckDB store (tests/helpers/calibration.py: TTFT ±10 %, TPOT ±5 %,
pace ±8 % per run, two load levels, 1 % failures); the reports are built by the CLI's own entry
point.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from servescope import cli
from servescope.reports import verdict
from servescope.store import Store
from tests.helpers.calibration import Comparison, store_comparison
from tests.helpers.cli import servescope
from tests.helpers.markdown import markdown_text

A_A = 20
EFFECTS = 5


def test_the_pooled_report_shows_each_repeat(calibration: dict[str, Any]) -> None:
    c = calibration["effect"][1]
    out = calibration["out"]
    done = servescope(
        "report", "build", *arms(c), "--store", str(calibration["db"]), "--out", str(out),
        check=True,
    )  # fmt: skip
    folder = Path(done.stdout.split()[0]).parent  # the paths it printed
    assert folder.name.startswith(c.after[0])
    report = json.loads((folder / "report.json").read_text())
    assert report["repeats"]["before"] == report["repeats"]["after"] == 5
    assert report["repeats"]["after_runs"] == c.after
    assert report["repeats"]["covers"] == "run-to-run and request noise"
    lead = next(d for d in report["diff"] if d["role"] == "primary")
    assert len(lead["repeats"]["before"]) == len(lead["repeats"]["after"]) == 5
    assert lead["test"]["method"] == "repeats"
    assert "5 repeats a side" in report["headline"]
    assert report["headline"] in " ".join(done.stderr.split())
    # each level against its counterpart; the server counters and the GPU are whole-run rows
    assert {d["level"] for d in report["diff"]} == {
        "chat · concurrency 4", "chat · concurrency 8", "all levels (stratified)", "whole run"
    }  # fmt: skip
    assert report["power"]["known"] and report["power"]["repeats_for"][0]["change_pct"] == 5
    md = markdown_text((folder / "report.md").read_text())
    html = (folder / "index.html").read_text()
    first = f"{lead['repeats']['after'][0]:,.1f}"
    assert first in md and first in html
    assert "to detect ±5 % TTFT p50:" in md
    assert html.count('<svg class="strip"') >= 10  # the strip of dots, one per tested row
    assert html.count('r="2.6"') >= 60


def test_bad_comparisons_are_refused_in_one_line(
    calibration: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    c = calibration["aa"][1]
    db, out = str(calibration["db"]), str(calibration["out"])
    for args, words in (
        ([*c.after], "compare them with --vs"),
        ([*arms(c), "--primary", "nonsense"], "unknown --primary"),
        ([*arms(c), "--since", "start+1s"], "take one run a side"),
        ([c.after[0], "--vs", "previous", c.before[0]], "--vs previous compares one run"),
        ([*arms(c)[:1], "--vs", "run-nobody"], "unknown run"),
        ([c.after[0], c.after[0], "--vs", *c.before], "is named twice"),
        ([c.after[0], c.before[0], "--vs", *c.before], "is on both sides"),
    ):
        code = cli.main(["report", "build", *args, "--store", db, "--out", out])
        err = capsys.readouterr()
        assert code == 2, (args, err)
        assert words in err.out + err.err, (args, err)
    result = servescope("report", "build", *arms(c), "--fail-on", "worse", "--store", db)
    assert result.returncode == 2 and "--fail-on takes improved or regressed" in result.stderr
    assert "Traceback" not in result.stderr


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
    effect = [  # five a side: a look the stopping rule reads at its 98.7 % level
        store_comparison(store, f"fx{i}", seed=100 + i, repeats=5, ttft_effect=0.75)
        for i in range(EFFECTS)
    ]
    return {"db": db, "out": folder / "reports", "aa": aa, "effect": effect}


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
    assert "(5 repeats a side): TPOT p50 over all load levels (stratified) " in brief["headline"]
