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

from typing import Any

import duckdb

from reports.samples import Slice
from store import queries

DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


def shape(rows: list[tuple[str, str | None, float, int]]) -> dict[str, Any] | None:
    """(name, position, delta, samples) rows into the report's numbers; None when the server
    exported no spec-decode counter (speculation off) or they were sampled fewer than twice."""
    totals: dict[str, float] = {}
    positions: dict[int, float] = {}
    for name, position, delta, samples in rows:
        if samples < 2:
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
    measured = accepted is not None
    return {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if measured and draft_tokens else None,
        "accepted_per_draft": accepted / drafts if measured and drafts else None,
        "per_position": [
            {"position": p, "accepted": n, "rate": n / drafts if drafts else None}
            for p, n in sorted(positions.items())
        ],
    }


def spec_decode(con: duckdb.DuckDBPyConnection, part: Slice) -> dict[str, Any] | None:
    """The slice's speculative-decoding numbers, overall and per workload (None: not on)."""
    params = part.params()
    overall = shape(con.execute(queries.SLICE_SPEC_DECODE, params).fetchall())
    if overall is None:
        return None
    by_workload: dict[str, list[tuple[str, str | None, float, int]]] = {}
    for workload, *row in con.execute(queries.SLICE_SPEC_DECODE_BY_WORKLOAD, params).fetchall():
        by_workload.setdefault(workload, []).append(tuple(row))  # type: ignore[arg-type]
    workloads = [
        {"workload": name, **numbers}
        for name, rows in by_workload.items()
        if (numbers := shape(rows)) is not None
    ]
    return {**overall, "workloads": workloads}


def _p(group: dict[str, Any] | None, metric: str, q: str) -> float | None:
    return None if group is None else group[metric][q]


def _change(before: float | None, after: float | None) -> float | None:
    return (after - before) / before * 100.0 if before and after is not None else None


def _by_workload(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each workload's latency group (the first level of it: speculation runs at one level)."""
    groups: dict[str, dict[str, Any]] = {}
    for group in summary["groups"]:
        groups.setdefault(group["workload"], group)
    return groups


def spec_diff(
    before: dict[str, Any], after: dict[str, Any], rows: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """The diff's speculative-decoding section: per workload (and overall) the acceptance on each
    side next to TPOT and ITL p50 before/after; overall TPOT rows keep their bootstrap verdict.
    None when neither side ran with speculation."""
    b_spec, a_spec = before["server"].get("spec_decode"), after["server"].get("spec_decode")
    if b_spec is None and a_spec is None:
        return None
    by_metric = {r["metric"]: r for r in rows}
    b_groups, a_groups = _by_workload(before), _by_workload(after)
    b_accept = {w["workload"]: w for w in (b_spec or {}).get("workloads", [])}
    a_accept = {w["workload"]: w for w in (a_spec or {}).get("workloads", [])}
    workloads = []
    for name in [*a_groups, *(n for n in b_groups if n not in a_groups)]:
        b_group, a_group = b_groups.get(name), a_groups.get(name)
        entry: dict[str, Any] = {
            "workload": name,
            "acceptance_before": (b_accept.get(name) or {}).get("acceptance_rate"),
            "acceptance_after": (a_accept.get(name) or {}).get("acceptance_rate"),
            "accepted_per_draft_after": (a_accept.get(name) or {}).get("accepted_per_draft"),
        }
        for metric in ("tpot_ms", "itl_ms"):
            b, a = _p(b_group, metric, "p50"), _p(a_group, metric, "p50")
            entry[f"{metric}_p50_before"], entry[f"{metric}_p50_after"] = b, a
            entry[f"{metric}_p50_change_pct"] = _change(b, a)
        workloads.append(entry)
    return {
        "on_before": b_spec is not None,
        "on_after": a_spec is not None,
        "acceptance_before": (b_spec or {}).get("acceptance_rate"),
        "acceptance_after": (a_spec or {}).get("acceptance_rate"),
        "tpot": [by_metric[m] for m in ("tpot_ms.p50", "tpot_ms.p95") if m in by_metric],
        "itl_ms_p50_before": before["overall"]["itl_ms"]["p50"],
        "itl_ms_p50_after": after["overall"]["itl_ms"]["p50"],
        "workloads": workloads,
    }


def headline_part(section: dict[str, Any] | None, rows: list[dict[str, Any]]) -> str | None:
    """E.g. "TPOT p50 −31 % [improved], draft acceptance off → 62 %" for the headline."""
    if section is None:
        return None
    by = {r["metric"]: r for r in rows}
    parts = []
    tpot = by.get("tpot_ms.p50")
    if tpot and tpot["delta_pct"] is not None:
        change = round(tpot["delta_pct"])
        sign = "±" if change == 0 else ("−" if change < 0 else "+")
        parts.append(f"TPOT p50 {sign}{abs(change)} % [{tpot['verdict']}]")

    def share(value: float | None, on: bool) -> str:
        if not on:
            return "off"
        return "n/a" if value is None else f"{value * 100:.0f} %"

    before = share(section["acceptance_before"], section["on_before"])
    after = share(section["acceptance_after"], section["on_after"])
    parts.append(f"draft acceptance {before} → {after}")
    return ", ".join(parts)
