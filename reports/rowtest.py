"""Each diff row's test: on the runs' values when an arm has several (reports/verdict.py's
Student's t, the runs' request noise as a floor), else on one run a side's request-level
bootstrap draws; either way the row keeps the `Evidence` its interval and verdict are read
from (reports/judge.py, which corrects the rows as a family)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from servescope.reports import verdict
from servescope.reports.bootstrap import Draws, Floats
from servescope.reports.document import DiffRow
from servescope.reports.judge import AS_IS, LOG, WHOLE_RUN, Evidence


@dataclass
class Estimates:
    """One indicator at one level on every run of an arm: the runs' values, their request-level
    draws, and the arm's pooled value (requests of every repeat pooled for a quantile, the mean
    of the repeats otherwise)."""

    values: list[float | None]
    draws: list[Draws | None]
    pooled: float | None
    counts: list[int]


def on_scale(values: Sequence[float | None], scale: str) -> Floats:
    """The values on the test's scale; a run without the value is NaN (numpy reads None so)."""
    array = np.asarray(values, dtype=np.float64)
    return np.log(array) if scale == LOG else array


def repeats_evidence(
    row: DiffRow, metric: str, scale: str, before: Estimates, after: Estimates, seed: int
) -> Evidence:
    """The row tested on the runs' values (reports/verdict.py), on the indicator's scale."""
    values = [v for v in (*before.values, *after.values) if v is not None]
    scale = scale if all(v > 0 for v in values) else AS_IS
    rng = np.random.default_rng([seed, *metric.encode(), *row["level"].encode()])

    def scaled_draws(est: Estimates) -> list[Floats | None]:
        out: list[Floats | None] = []
        for drawn in est.draws:
            if drawn is None:
                out.append(None)
                continue
            got = drawn(rng)
            out.append(on_scale(list(got), scale) if scale == AS_IS or np.all(got > 0) else None)
        return out

    test = verdict.repeats_test(
        on_scale(before.values, scale),
        on_scale(after.values, scale),
        scaled_draws(before),
        scaled_draws(after),
    )
    if test is None:
        return Evidence()
    row["test"] = {
        "method": verdict.REPEATS,
        "scale": scale,
        "df": test.df,
        "spread": test.spread,
        "covers": "run-to-run and request noise",
        "request_share": test.request_share,
    }
    row["p_value"] = test.p_value
    return Evidence(float(np.sign(test.estimate)), test, scale)


def requests_evidence(
    row: DiffRow, metric: str, before: Estimates, after: Estimates, seed: int
) -> Evidence:
    """One run a side: the request-level bootstrap's draws (request noise only)."""
    key = metric if row["level"] == WHOLE_RUN else f"{metric}@{row['level']}"
    b_draws, a_draws = before.draws[0], after.draws[0]
    if b_draws is None or a_draws is None:
        return Evidence()
    rng = np.random.default_rng([seed, *key.encode()])
    b, a = b_draws(rng), a_draws(rng)
    delta = a - b
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = (a / b - 1.0) * 100.0
    row["test"] = {
        "method": verdict.REQUESTS,
        "scale": AS_IS,
        "df": None,
        "spread": None,
        "covers": "request noise only",
    }
    row["p_value"] = verdict.draws_p_value(delta)
    return Evidence(
        float(np.sign(np.median(delta))), delta=delta, rel=rel if np.all(np.isfinite(rel)) else None
    )
