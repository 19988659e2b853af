"""Speculative decoding in a report: how many drafts vLLM proposed, how many of their tokens the
target model accepted, and where in a draft acceptance stops; in a diff, TPOT and ITL next to it.

All of it comes from the run's scraped `/metrics` counters (deltas over the slice, and over each
workload's window): `vllm:spec_decode_num_drafts_total`, `…_num_draft_tokens_total`,
`…_num_accepted_tokens_total` and `…_num_accepted_tokens_per_pos_total{position}`. A server
without speculation exports none of them, and the section is then None ("off"), not zeros.

- acceptance rate = accepted tokens / draft tokens (vLLM's "draft acceptance rate");
- accepted per draft = accepted tokens / drafts: the mean accepted length of a draft, 0…k
  (vLLM logs 1 + this as "mean acceptance length": each verify step also yields one token of
  the target model's own);
- per position i = accepted at position i / drafts: the share of drafts whose first i+1 tokens
  were all accepted (a draft is accepted up to its first wrong token).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

import duckdb
import numpy as np

from servescope.reports import bootstrap, sql
from servescope.reports.document import (
    AcceptedAt,
    DiffRow,
    Group,
    SpecDecode,
    SpecDecodeDiff,
    SpecNumbers,
    SpecWorkload,
    SpecWorkloadDiff,
    Summary,
)
from servescope.reports.samples import Slice
from servescope.reports.verdict import (
    LOWER,
    MIN_TAIL_SAMPLES,
    NOT_MEASURED,
    TOO_FEW,
    verdict_of,
)

DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


Row = tuple[str, str | None, float, int]  # (counter, position, delta, steps) of SLICE_SPEC_DECODE


def shape(rows: list[Row]) -> SpecNumbers | None:
    """(name, position, delta, steps) rows into the report's numbers; None when the server
    exported no spec-decode counter (speculation off) or the samples measure no step of them."""
    totals: dict[str, float] = {}
    positions: dict[int, float] = {}
    for name, position, delta, steps in rows:
        if not steps:
            continue
        if name == PER_POSITION and position is not None:
            positions[int(position)] = positions.get(int(position), 0.0) + float(delta)
        else:
            totals[name] = totals.get(name, 0.0) + float(delta)
    if DRAFTS not in totals:
        return None
    drafts = totals[DRAFTS]
    draft_tokens = totals.get(DRAFT_TOKENS)
    accepted = totals.get(ACCEPTED)
    return SpecNumbers(
        drafts=drafts,
        draft_tokens=draft_tokens,
        accepted_tokens=accepted,
        acceptance_rate=accepted / draft_tokens if accepted is not None and draft_tokens else None,
        accepted_per_draft=accepted / drafts if accepted is not None and drafts else None,
        per_position=[
            AcceptedAt(position=p, accepted=n, rate=n / drafts if drafts else None)
            for p, n in sorted(positions.items())
        ],
    )


def spec_decode(con: duckdb.DuckDBPyConnection, part: Slice) -> SpecDecode | None:
    """The slice's speculative-decoding numbers, overall and per workload (None: not on)."""
    params = part.params()
    overall = shape(con.execute(sql.SLICE_SPEC_DECODE, params).fetchall())
    if overall is None:
        return None
    by_workload: dict[str | None, list[Row]] = {}
    for workload, name, position, delta, steps in con.execute(
        sql.SLICE_SPEC_DECODE_BY_WORKLOAD, params
    ).fetchall():
        by_workload.setdefault(workload, []).append((name, position, delta, steps))
    workloads = [
        SpecWorkload(workload=name, **numbers)
        for name, rows in by_workload.items()
        if (numbers := shape(rows)) is not None
    ]
    return SpecDecode(**overall, workloads=workloads)


def _itl_p50(group: Group | None) -> float | None:
    return None if group is None else group["itl_ms"]["p50"]


def _change(before: float | None, after: float | None) -> float | None:
    return (after - before) / before * 100.0 if before and after is not None else None


def _by_workload(summary: Summary) -> dict[str | None, Group]:
    """Each workload's latency group (the first level of it: speculation runs at one level)."""
    groups: dict[str | None, Group] = {}
    for group in summary["groups"]:
        groups.setdefault(group["workload"], group)
    return groups


def _tpots(
    con: duckdb.DuckDBPyConnection, part: Slice, source: str
) -> dict[str | None, np.ndarray]:
    figure = "server_tpot_ms" if source == "server" else "tpot_ms"
    rows = con.execute(sql.SLICE_WORKLOAD_TPOT[figure], part.params()).fetchall()
    return {name: np.asarray(values, dtype=np.float64) for name, values in rows}


class TpotTest(TypedDict):
    """TPOT p50 of one workload on both sides, tested as the diff's rows are."""

    tpot_ms_p50_before: float | None
    tpot_ms_p50_after: float | None
    tpot_ms_p50_change_pct: float | None
    tpot_ms_p50_ci95_pct: list[float] | None
    tpot_verdict: str


def _tpot_test(
    before: np.ndarray | None, after: np.ndarray | None, seed: int, key: str
) -> TpotTest:
    """TPOT p50 of one workload on both sides, with the diff's bootstrap interval and verdict."""
    b = bootstrap.quantile(before, 0.5) if before is not None else None
    a = bootstrap.quantile(after, 0.5) if after is not None else None
    ci, ci_pct = bootstrap.delta_interval(
        bootstrap.quantile_draws(before, 0.5) if before is not None else None,
        bootstrap.quantile_draws(after, 0.5) if after is not None else None,
        seed,
        key,
    )
    verdict = verdict_of(b, a, ci if b is not None and a is not None else None, LOWER)
    # a side with no TPOT at all (every stream came in one chunk: the decode was not seen) is
    # not measured, as the diff's own rows say; one with a few is too few
    if before is None or after is None or not (len(before) and len(after)):
        verdict = NOT_MEASURED
    elif min(len(before), len(after)) * 0.5 < MIN_TAIL_SAMPLES:
        verdict = TOO_FEW
    return TpotTest(
        tpot_ms_p50_before=b,
        tpot_ms_p50_after=a,
        tpot_ms_p50_change_pct=_change(b, a),
        tpot_ms_p50_ci95_pct=list(ci_pct) if ci_pct else None,
        tpot_verdict=verdict,
    )


def spec_diff(
    con: duckdb.DuckDBPyConnection,
    parts: tuple[Slice, Slice],
    summaries: tuple[Summary, Summary],
    rows: Sequence[DiffRow],
    seed: int,
) -> SpecDecodeDiff | None:
    """The diff's speculative-decoding section: per workload the acceptance on each side next
    to TPOT p50 (with a bootstrap interval and verdict, as the diff's rows) and ITL p50; overall,
    the diff's own TPOT rows. None when neither side ran with speculation."""
    before, after = summaries
    b_spec, a_spec = before["server"]["spec_decode"], after["server"]["spec_decode"]
    if b_spec is None and a_spec is None:
        return None
    by_metric = {r["metric"]: r for r in rows}
    b_groups, a_groups = _by_workload(before), _by_workload(after)
    source = before["overall"]["sources"]["tpot_ms"]  # the diff's TPOT source, both sides
    b_tpot, a_tpot = _tpots(con, parts[0], source), _tpots(con, parts[1], source)
    b_accept = {w["workload"]: w for w in b_spec["workloads"]} if b_spec else {}
    a_accept = {w["workload"]: w for w in a_spec["workloads"]} if a_spec else {}
    workloads = []
    for name in [*a_groups, *(n for n in b_groups if n not in a_groups)]:
        itl_b, itl_a = _itl_p50(b_groups.get(name)), _itl_p50(a_groups.get(name))
        b_w, a_w = b_accept.get(name), a_accept.get(name)
        workloads.append(
            SpecWorkloadDiff(
                workload=name,
                acceptance_before=b_w["acceptance_rate"] if b_w else None,
                acceptance_after=a_w["acceptance_rate"] if a_w else None,
                accepted_per_draft_after=a_w["accepted_per_draft"] if a_w else None,
                **_tpot_test(b_tpot.get(name), a_tpot.get(name), seed, f"spec.tpot.{name}"),
                itl_ms_p50_before=itl_b,
                itl_ms_p50_after=itl_a,
                itl_ms_p50_change_pct=_change(itl_b, itl_a),
            )
        )
    return SpecDecodeDiff(
        on_before=b_spec is not None,
        on_after=a_spec is not None,
        acceptance_before=b_spec["acceptance_rate"] if b_spec else None,
        acceptance_after=a_spec["acceptance_rate"] if a_spec else None,
        tpot=[by_metric[m] for m in ("tpot_ms.p50", "tpot_ms.p95") if m in by_metric],
        itl_ms_p50_before=before["overall"]["itl_ms"]["p50"],
        itl_ms_p50_after=after["overall"]["itl_ms"]["p50"],
        workloads=workloads,
    )


def _pct(value: float) -> str:
    change = round(value)
    return f"{'±' if change == 0 else ('−' if change < 0 else '+')}{abs(change)} %"


def _tpot_change(before: float | None, after: float | None, pct: float | None) -> str:
    """A change as "−31 %", or as "0.00 → 2.14 ms" from a zero: a burst of tokens in one chunk
    has TPOT 0, and a change from 0 is no percentage. "n/a" unless both sides were measured (the
    verdict beside it says why: not measured)."""
    if pct is not None:
        return _pct(pct)
    if before is not None and after is not None:
        return f"{before:.2f} → {after:.2f} ms"
    return "n/a"


def headline_part(section: SpecDecodeDiff | None, rows: Sequence[DiffRow]) -> str | None:
    """E.g. "TPOT p50 −31 % [improved], draft acceptance off → 62 %" for the headline."""
    if section is None:
        return None
    by = {r["metric"]: r for r in rows}
    parts = []
    tpot = by.get("tpot_ms.p50")
    if tpot:
        change = _tpot_change(tpot["before"], tpot["after"], tpot["delta_pct"])
        parts.append(f"TPOT p50 {change} [{tpot['verdict']}]")
    for w in section["workloads"]:
        change = _tpot_change(
            w["tpot_ms_p50_before"], w["tpot_ms_p50_after"], w["tpot_ms_p50_change_pct"]
        )
        if w["acceptance_after"] is not None:
            parts.append(
                f"{w['workload']}: TPOT p50 {change} [{w['tpot_verdict']}] "
                f"at {w['acceptance_after'] * 100:.0f} % acceptance"
            )

    def share(value: float | None, on: bool) -> str:
        if not on:
            return "off"
        return "n/a" if value is None else f"{value * 100:.0f} %"

    before = share(section["acceptance_before"], section["on_before"])
    after = share(section["acceptance_after"], section["on_after"])
    parts.append(f"draft acceptance {before} → {after}")
    return ", ".join(parts)
