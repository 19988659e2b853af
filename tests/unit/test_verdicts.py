"""The verdicts' arithmetic, checked against statistics tables and by hand: Student's critical
values, Holm's step-down and the repeats test. The calibration on synthetic repeats, which builds
reports through the CLI, is tests/integration/test_verdicts.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from servescope.reports import verdict


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
    wide = [np.random.default_rng(0).normal(0, 1, 4000)] * 3
    floored = verdict.repeats_test(before, after, wide, wide)
    assert floored is not None and floored.df == 4  # still Student's critical value
    assert floored.error == pytest.approx(math.sqrt(2 / 3), rel=0.05)
    assert verdict.repeats_test([1.0], [2.0]) is None  # one run a side: nothing to estimate
    needed = [verdict.repeats_needed(0.1, change) for change in (0.05, 0.1, 0.3)]
    assert needed[0] is None and needed[1] > needed[2] >= 2


def test_a_change_is_never_said_beyond_a_thousand_percent() -> None:
    """Two runs a side bound throughput's change at +7 × 10^20 % at the stopping rule's level:
    a true bound, and no reader can use it. Every report says it as "> +1,000 %"; a fall stays
    as it is (a time or a rate cannot fall below −100 %), and nothing rounds to "−0"."""
    assert verdict.signed_change(7.05e20) == "> +1,000"
    assert verdict.signed_change(verdict.MAX_READABLE_PCT) == "+1,000"
    assert verdict.signed_change(-99.96) == "−100"
    assert verdict.signed_change(-0.4) == "±0" and verdict.signed_change(0.04, 1) == "±0.0"
    assert verdict.signed_change(-54.25, 1) == "−54.2"
