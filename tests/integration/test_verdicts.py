"""Verdicts calibrated on repeats: synthetic A/A comparisons with run-level drift (nothing
changed) must come out without a verdict, and a true −25 % TTFT must be found, through the
command a CI step types (`report build A1 A2 A3 --vs B1 B2 B3 --fail-on regressed --json`).

The runs are written to a real DuckDB store (tests/calibration.py: TTFT ±10 %, TPOT ±5 %, pace
±8 % per run, two load levels, 1 % failures); the reports are built by the CLI's own entry point.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from servescope import cli
from tests.conftest import servescope
from tests.integration.test_report import markdown_text
from tests.unit.test_verdicts import arms


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
    assert report["repeats"]["before"] == report["repeats"]["after"] == 3
    assert report["repeats"]["after_runs"] == c.after
    assert report["repeats"]["covers"] == "run-to-run and request noise"
    lead = next(d for d in report["diff"] if d["role"] == "primary")
    assert len(lead["repeats"]["before"]) == len(lead["repeats"]["after"]) == 3
    assert lead["test"]["method"] == "repeats"
    assert "3 repeats a side" in report["headline"]
    assert report["headline"] in " ".join(done.stderr.split())
    # each level against its counterpart; the server counters and the GPU are whole-run rows
    assert {d["level"] for d in report["diff"]} == {
        "chat · concurrency 4", "chat · concurrency 8", "whole run"
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
