"""Verdicts for a comparison's rows, and the decision a report leads with.

Every tested row keeps its `Evidence` (the test on the runs' values, or one run a side's
bootstrap draws), so that its interval can be read at the level its verdict was reached at:
the primary's at the stopping rule's level (reports/sequential.py), each other row's at the
level Holm's step-down procedure tested it at. The interval a row shows is therefore the one
its verdict reads, and the two never disagree on their face (a row its own 5 % test would call
a change but the family's correction does not shows the corrected interval, across 0).

The words are here too: what "unchanged" could have missed, in the indicator's units where a
ratio misleads (a time cannot fall below −100 %; a share at 0 has no ratio), and the decision's
sentence.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from servescope.reports import verdict
from servescope.reports.bootstrap import Floats
from servescope.reports.document import Decision, DiffRow, Power, PowerLine, Primary
from servescope.reports.samples import SERVER
from servescope.reports.sequential import Plan, bounds, read
from servescope.reports.verdict import (
    IMPROVED,
    NOT_TESTED,
    REGRESSED,
    UNCHANGED,
    UNDECIDED,
)

LOG, AS_IS = "log", "as is"
WHOLE_RUN = "whole run"
STRATIFIED = "all levels (stratified)"
DEFAULT_PRIMARY = "ttft_ms.p50"
POWER_CHANGES_PCT = (5.0, 10.0, 25.0)


@dataclass(frozen=True)
class Evidence:
    """What a row's interval is made of: the test on the runs' values (`test`, on `scale`), or
    one run a side's bootstrap draws of after − before (`delta`) and of the change in percent
    (`rel`, None when a draw divides by 0). `direction`: the sign of the estimated change."""

    direction: float = 0.0
    test: verdict.Test | None = None
    scale: str = AS_IS
    delta: Floats | None = None
    rel: Floats | None = None

    def read(self, row: DiffRow, level: float) -> None:
        """Write the row's interval and its detectable change (80 % power) at two-sided
        `level`."""
        before = row["before"] or 0.0
        row["confidence"] = 1.0 - level
        if self.test is not None:
            test = self.test
            critical = verdict.t_critical(test.df, level)
            lo, hi = test.estimate - critical * test.error, test.estimate + critical * test.error
            reach = (critical + verdict.POWER_Z) * test.error
            if self.scale == LOG:
                pct = [math.expm1(lo) * 100.0, math.expm1(hi) * 100.0]
                row["ci95_pct"] = pct
                row["ci95"] = [before * pct[0] / 100.0, before * pct[1] / 100.0]
                row["detectable_pct"] = reach_pct = math.expm1(reach) * 100.0
                row["detectable"] = before * reach_pct / 100.0
            else:
                row["ci95"] = [lo, hi]
                row["ci95_pct"] = [lo / before * 100.0, hi / before * 100.0] if before else None
                row["detectable"] = reach
                row["detectable_pct"] = reach / before * 100.0 if before else None
            return
        if self.delta is None:
            return
        cut = [level / 2 * 100.0, (1.0 - level / 2) * 100.0]
        lo, hi = (float(x) for x in np.percentile(self.delta, cut))
        row["ci95"] = [lo, hi]
        # a half-width is z standard errors; 80 % power takes (z + 0.84) of them
        z = verdict.t_critical(None, level)
        to_detectable = (z + verdict.POWER_Z) / z / 2
        if self.rel is not None:
            p_lo, p_hi = (float(x) for x in np.percentile(self.rel, cut))
            row["ci95_pct"] = [p_lo, p_hi]
            row["detectable_pct"] = (p_hi - p_lo) * to_detectable
        row["detectable"] = (hi - lo) * to_detectable


def _call(row: DiffRow, direction: float) -> str:
    lower = direction < 0
    return IMPROVED if lower == (row["better"] == "lower") else REGRESSED


def _family(rows: list[DiffRow], evidence: Sequence[Evidence], family: list[int]) -> None:
    """Holm's step-down procedure at FAMILY_ALPHA, each row's interval read at the level its
    step tested it at; the rows after the first that is not rejected all at that step's level
    (their p-values are larger, so their intervals cross 0 as their verdicts say)."""
    adjusted = verdict.holm_adjusted([rows[i]["p_value"] or 0.0 for i in family])
    order = sorted(range(len(family)), key=lambda j: rows[family[j]]["p_value"] or 0.0)
    stopped_at: float | None = None
    for rank, j in enumerate(order):
        i = family[j]
        row = rows[i]
        row["role"] = "secondary"
        row["p_adjusted"] = adjusted[j]
        level = verdict.FAMILY_ALPHA / (len(family) - rank)
        if stopped_at is None and (row["p_value"] or 0.0) <= level:
            evidence[i].read(row, level)
            row["verdict"] = _call(row, evidence[i].direction)
            continue
        stopped_at = stopped_at if stopped_at is not None else level
        evidence[i].read(row, stopped_at)
        row["verdict"] = UNCHANGED


def _lead(rows: list[DiffRow], metric: str, level: str) -> int | None:
    tested = [i for i, r in enumerate(rows) if r["p_value"] is not None]
    for name in dict.fromkeys((metric, DEFAULT_PRIMARY)):  # the default when it is not tested
        found = [i for i in tested if rows[i]["metric"] == name]
        lead = next((i for i in found if rows[i]["level"] in (level, WHOLE_RUN)), None)
        lead = found[0] if lead is None and found else lead
        if lead is not None:
            return lead
    return None


def judge(
    rows: list[DiffRow],
    evidence: Sequence[Evidence],
    primary: tuple[str, str],
    why: str,
    look: int,
    plan: Plan,
    stopped: tuple[str, str] | None = None,
) -> tuple[Primary, Decision]:
    """Verdicts for the tested rows: the primary row (metric, level) by the stopping rule at
    `look` repeats a side (one run a side: its 95 % bootstrap interval, request noise only),
    every other tested row by Holm's procedure at 2.5 % family-wise. Returns what the report
    says about the primary (`why`: why that metric leads) and the decision; `stopped` is (why
    the experiment stopped, in words), None for stored runs."""
    metric, level = primary
    lead = _lead(rows, metric, level)
    family = [i for i, r in enumerate(rows) if r["p_value"] is not None and i != lead]
    _family(rows, evidence, family)
    more: int | None = None
    confidence = 1.0 - verdict.ALPHA
    if lead is not None:
        row, found = rows[lead], evidence[lead]
        row["role"] = "primary"
        row["p_adjusted"] = row["p_value"] or 0.0
        if found.test is not None:
            reading = read(found.test, plan, look, log_scale=found.scale == LOG,
                           before=row["before"], better_lower=row["better"] == "lower",
                           share=is_share(row["metric"]))  # fmt: skip
            found.read(row, 1.0 - reading.confidence)
            row["verdict"], more, confidence = (
                reading.verdict,
                reading.more_repeats,
                reading.confidence,
            )
        else:
            found.read(row, verdict.ALPHA)
            row["verdict"] = _one_run_verdict(row, found, plan.margin_pct)
    chosen = rows[lead]["metric"] if lead is not None else metric
    if chosen != metric:
        why += f"; {metric} is not tested on both sides, so {chosen} leads"
    at = rows[lead]["level"] if lead is not None else level
    return Primary(
        metric=chosen,
        level=at,
        asked=metric,
        alpha=verdict.ALPHA,
        family_alpha=verdict.FAMILY_ALPHA,
        family=len(family),
        correction="holm",
        why=why,
    ), decision(rows[lead] if lead is not None else None, chosen, at, look, plan, stopped,
                more, confidence)  # fmt: skip


def _one_run_verdict(row: DiffRow, found: Evidence, margin_pct: float) -> str:
    """One run a side: the 95 % interval of request noise only, read as the rule reads one."""
    if (row["p_value"] or 1.0) <= verdict.ALPHA:
        return _call(row, found.direction)
    ci = row["ci95"]
    margin = bounds(margin_pct, False, row["before"], is_share(row["metric"]))
    if ci is not None and margin is not None and margin[0] <= ci[0] and ci[1] <= margin[1]:
        return UNCHANGED
    return UNDECIDED


REASONS = {
    "decided": "stopped: decided after {look} repeats a side",
    "budget": "stopped: the time budget ran out after {look} repeats a side",
    "max repeats": "stopped: the plan's {last} repeats a side were run",
    "interrupted": "stopped: interrupted after {look} repeats a side",
}


def decision(
    row: DiffRow | None,
    metric: str,
    level: str,
    look: int,
    plan: Plan,
    stopped: tuple[str, str] | None,
    more: int | None,
    confidence: float,
) -> Decision:
    """The primary's verdict as the report's first line says it."""
    server = " (server)" if row is not None and row["source"] == SERVER else ""
    name = metric_name(metric) + server + (" over all load levels (stratified)"
                                           if level == STRATIFIED else "")  # fmt: skip
    how, reason = stopped if stopped is not None else (None, "")
    if not reason:
        reason = (
            REASONS[how].format(look=look, last=plan.last)
            if how in REASONS
            else f"stored runs, read as a look of {look} repeats a side"
        )
    found = row["verdict"] if row is not None else NOT_TESTED
    words = ""
    pct = row["ci95_pct"] if row is not None else None
    if row is not None and is_share(metric) and row["ci95"] is not None:
        lo, hi = (_points(100.0 * x) for x in row["ci95"])
        change = f"{_share_pct(row['before'])} → {_share_pct(row['after'])} ({lo} … {hi} pp)"
        words = _decision_words(found, name, change, f"±{plan.margin_pct / 10:g} pp")
    elif row is not None and row["delta_pct"] is not None and pct is not None:
        shown = f"{signed_pct(pct[0])[:-2]} … {signed_pct(pct[1])}"
        change = f"{signed_pct(row['delta_pct'])} ({shown})"
        words = _decision_words(found, name, change, f"±{plan.margin_pct:g} %")
    if row is None or not words or found == NOT_TESTED:
        words = f"{name}: not tested on both sides"
    else:
        if found == UNDECIDED:
            words += (
                f"; about {more} more repeats a side would decide"
                if more
                else f"; more than {verdict.REPEATS_CAP} repeats a side would be needed"
                if row["test"] is not None and row["test"]["method"] == verdict.REPEATS
                else "; run 3 or more repeats a side to decide"
            )
        one = row["test"] is not None and row["test"]["method"] == verdict.REQUESTS
        runs = "one run a side: request noise only" if one else f"{look} repeats a side"
        words += f" ({confidence * 100:.1f} % interval, {runs})"
    return Decision(
        metric=metric,
        level=level,
        verdict=found,
        before=row["before"] if row is not None else None,
        after=row["after"] if row is not None else None,
        estimate_pct=row["delta_pct"] if row is not None else None,
        interval_pct=pct,
        interval=row["ci95"] if row is not None else None,
        confidence=confidence,
        margin_pct=plan.margin_pct,
        look=look,
        plan=[plan.first, plan.covering(look).last],
        stopped=how,
        more_repeats=more,
        reason=reason,
        words=words,
    )


def _decision_words(found: str, name: str, change: str, margin: str) -> str:
    return {
        IMPROVED: f"{name} improved: {change}",
        REGRESSED: f"{name} regressed: {change}",
        UNCHANGED: f"{name} unchanged within {margin}: {change}",
    }.get(found, f"{name} undecided: {change} neither excludes no change nor lies within "
                 f"{margin}")  # fmt: skip


def _points(value: float) -> str:
    """A signed change in points with a true minus sign: −0.1, +2.0."""
    return f"{'−' if value < 0 else '+'}{abs(value):.1f}"


def _share_pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.1f} %"


# -- power ----------------------------------------------------------------------------------


def power(rows: list[DiffRow], primary: Primary) -> Power | None:
    """What the design could detect on the primary row, and how many repeats a side would find
    a change of 5, 10 and 25 % (80 % power at 5 %), from the run-to-run spread observed. With
    one run a side the spread between runs is unknown: the lines are None and say so."""
    row = next(
        (r for r in rows if r["metric"] == primary["metric"] and r["level"] == primary["level"]),
        None,
    )
    if row is None or row["test"] is None:
        return None
    test = row["test"]
    lines: list[PowerLine] = []
    for change in POWER_CHANGES_PCT:
        needed = None
        if test["method"] == verdict.REPEATS and test["spread"] is not None:
            if test["scale"] == LOG:
                size = float(np.log1p(change / 100.0))
            else:
                size = abs(row["before"] or 0.0) * change / 100.0
            needed = verdict.repeats_needed(test["spread"], size)
        lines.append(PowerLine(change_pct=change, repeats_a_side=needed))
    return Power(
        metric=row["metric"],
        level=row["level"],
        detectable_pct=row["detectable_pct"],
        detectable=row["detectable"],
        repeats_for=lines,
        known=test["method"] == verdict.REPEATS,
        cap=verdict.REPEATS_CAP,
    )


def power_lines(power: Power | None) -> list[str]:
    """The power section in words: "to detect ±5 % TTFT p50: 6 repeats a side"."""
    if power is None:
        return []
    name = metric_name(power["metric"])
    if not power["known"]:
        return [
            f"{name}: with one run a side the run-to-run variation is unknown, so no number of "
            "repeats can be given; run 3 or more a side to measure it"
        ]
    lines = []
    for line in power["repeats_for"]:
        k = line["repeats_a_side"]
        needed = f"{k} repeats a side" if k else f"more than {power['cap']} repeats a side"
        lines.append(f"to detect ±{line['change_pct']:.0f} % {name}: {needed}")
    return lines


# -- words ----------------------------------------------------------------------------------


def signed_pct(value: float) -> str:
    return f"{verdict.signed_change(value)} %"


def corrected_away(row: DiffRow) -> bool:
    """A row its own 95 % test calls a change that the family's correction does not."""
    p = row.get("p_value")
    return row.get("role") == "secondary" and p is not None and p <= verdict.ALPHA


def is_share(metric: str) -> bool:
    return metric.endswith("ratio") or metric == "error_rate"


UNITS = {"throughput.requests_per_s": "req/s", "goodput.requests_per_s": "req/s",
         "throughput.input_tokens_per_s": "tok/s", "throughput.output_tokens_per_s": "tok/s",
         "gpu.j_per_output_token": "J", "gpu.j_per_request": "J", "gpu.mean_power_w": "W",
         "gpu.gpu_util_pct": "pp"}  # fmt: skip


def unit_of(metric: str) -> str:
    """The indicator's unit as a report writes it: ms for times, pp (percentage points) for
    shares."""
    if is_share(metric):
        return "pp"
    return UNITS.get(metric, "ms")


def _amount(value: float) -> str:
    """A magnitude with about three significant digits: 0.0213, 4.27, 42.7, 1,234."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    digits = max(0, 2 - int(math.floor(math.log10(abs(value)))))
    return f"{value:,.{digits}f}"


def missed(row: DiffRow) -> str | None:
    """What an unchanged row could have missed (80 % power at its level): "no change beyond
    ±40 ms (±18 %)"; in the unit alone where a percentage misleads; None when unknown."""
    reach, reach_pct, before = row["detectable"], row["detectable_pct"], row["before"]
    if reach is None:
        return None
    unit = unit_of(row["metric"])
    if unit == "pp":  # a share: its change in percentage points
        return f"no change beyond ±{_amount(abs(reach) * 100)} pp"
    test = row["test"]
    if test is not None and test["scale"] == LOG and reach_pct is not None and before:
        up = reach_pct  # a time or rate: e^d − 1 up, 1 − e^−d down (never below −100 %)
        down = (1.0 - 1.0 / (1.0 + up / 100.0)) * 100.0
        if up <= 100.0:
            return f"no change beyond ±{_amount(before * up / 100.0)} {unit} (±{up:.0f} %)"
        units = f"−{_amount(before * down / 100.0)} … +{_amount(before * up / 100.0)} {unit}"
        if up <= verdict.MAX_READABLE_PCT:
            return f"no change beyond −{down:.0f} … +{up:,.0f} % ({units})"
        return f"no change beyond −{down:.0f} … {verdict.signed_change(up)} % (a rise not bounded)"
    shown = f"no change beyond ±{_amount(abs(reach))} {unit}"
    if reach_pct is not None and abs(reach_pct) <= verdict.MAX_READABLE_PCT:
        shown += f" (±{abs(reach_pct):.0f} %)"
    return shown


METRIC_NAMES = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "e2e_ms": "e2e", "queue_ms": "queue",
                "prefill_ms": "prefill", "decode_ms": "decode", "error_rate": "error rate",
                "throughput.output_tokens_per_s": "throughput",
                "throughput.requests_per_s": "requests/s",
                "server.prefix_cache_hit_ratio": "server prefix hit ratio",
                "gpu.j_per_output_token": "energy per output token"}  # fmt: skip


def metric_name(metric: str) -> str:
    """ "TTFT p50", "throughput", … as a headline says it."""
    if metric in METRIC_NAMES:
        return METRIC_NAMES[metric]
    column, _, q = metric.rpartition(".")
    return f"{METRIC_NAMES.get(column, column)} {q}" if column else metric
