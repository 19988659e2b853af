"""The pass criteria of a vLLM deployment, each filled from the run's data or marked.

The checklist: model loading (cold start and warm restart times recorded), API compatibility
(an OpenAI client completes a chat call), stability (0–2 timeouts/OOMs per 100 requests), cost
(GPU-hour vs API cost), observability (request_id, model, tokens and latency logged), security,
admission control (per-team queue isolated, rejection events logged).

A criterion the run could have shown and did not is "not measured", with what would measure
it; one no run can show (security: access permissions are the deployment's, not the traffic's)
is "not measurable here", so an operator does not look for a run that would fill it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

import duckdb

from servescope.reports import sql
from servescope.reports.document import ChecklistItem
from servescope.reports.samples import Slice
from servescope.reports.summary import ReportOptions
from servescope.store.reads import picked, row

PASS, FAIL, NOT_MEASURED = "pass", "fail", "not measured"
NOT_MEASURABLE = "not measurable here"
STABILITY_LIMIT_PER_100 = 2.0


def _item(item: str, criterion: str, status: str, evidence: str) -> ChecklistItem:
    return ChecklistItem(item=item, criterion=criterion, status=status, evidence=evidence)


def _chat_workloads(workload: Any) -> list[str]:
    """Names of the workloads the run's spec sends to the chat endpoint."""
    if not isinstance(workload, dict):
        return []
    return [
        str(w.get("name"))
        for w in workload.get("workloads") or []
        if isinstance(w, dict) and w.get("endpoint") == "chat"
    ]


def _loading(meta: Mapping[str, Any]) -> ChecklistItem:
    notes = meta.get("notes") or {}
    cold, warm = notes.get("cold_start_s"), notes.get("warm_restart_s")
    ready = meta.get("server_ready_s")
    parts = []
    if cold is not None:
        parts.append(f"cold start {cold:.1f} s")
    if warm is not None:
        parts.append(f"warm restart {warm:.1f} s")
    if cold is not None and warm is not None:
        return _item(
            "Model loading", "cold start and warm restart times recorded", PASS, ", ".join(parts)
        )
    if ready is not None and cold is None:
        parts.append(f"server ready after {ready:.1f} s (launcher; cold or warm not recorded)")
    missing = [n for n, v in (("cold start", cold), ("warm restart", warm)) if v is None]
    parts.append(f"{' and '.join(missing)} not measured")
    return _item(
        "Model loading",
        "cold start and warm restart times recorded",
        NOT_MEASURED,
        "; ".join(parts),
    )


def _compatibility(checks: Checks) -> ChecklistItem:
    criterion = "an OpenAI client completes a chat call"
    if not checks["chat_requests"]:
        return _item("API compatibility", criterion, NOT_MEASURED, "no chat requests in this run")
    status = PASS if checks["chat_ok"] else FAIL
    return _item(
        "API compatibility",
        criterion,
        status,
        f"{checks['chat_ok']} of {checks['chat_requests']} chat calls succeeded",
    )


def _stability(checks: Checks) -> ChecklistItem:
    criterion = f"≤ {STABILITY_LIMIT_PER_100:g} timeouts/OOMs per 100 requests"
    n = checks["requests"]
    if not n:
        return _item("Stability", criterion, NOT_MEASURED, "no requests")
    bad = checks["timeouts"] + checks["ooms"]
    per_100 = 100.0 * bad / n
    status = PASS if per_100 <= STABILITY_LIMIT_PER_100 else FAIL
    return _item(
        "Stability",
        criterion,
        status,
        f"{checks['timeouts']} timeouts + {checks['ooms']} OOMs in {n} requests = "
        f"{per_100:.2f} per 100",
    )


def _cost(overall: Mapping[str, Any], options: ReportOptions) -> ChecklistItem:
    criterion = "GPU-hour cost vs API cost per 1K tokens"
    gpu, api = options.gpu_hour_usd, options.api_usd_per_1k_tokens
    tput = overall["throughput"]
    tokens_per_s = None
    if tput["output_tokens_per_s"] is not None:
        tokens_per_s = tput["output_tokens_per_s"] + (tput["input_tokens_per_s"] or 0.0)
    if gpu is None or api is None:
        return _item(
            "Cost",
            criterion,
            NOT_MEASURED,
            "give --gpu-hour-usd and --api-usd-per-1k-tokens to compare",
        )
    if not tokens_per_s:
        return _item("Cost", criterion, NOT_MEASURED, "no token throughput measured")
    per_1k = gpu / (tokens_per_s * 3.6)  # $/h ÷ (tokens/s × 3600 s/h ÷ 1000)
    cheaper = "self-hosted is cheaper" if per_1k < api else "the API is cheaper"
    return _item(
        "Cost",
        criterion,
        PASS,
        f"${gpu:g}/GPU-hour at {tokens_per_s:,.1f} tokens/s (input + output) = "
        f"${per_1k:.4f} per 1K tokens vs API ${api:g} per 1K: {cheaper}",
    )


def _observability(checks: Checks) -> ChecklistItem:
    criterion = "request_id, model, tokens and latency on every event"
    if not checks["ok"]:
        return _item("Observability", criterion, NOT_MEASURED, "no successful requests")
    missing = checks["ok_missing_fields"]
    status = PASS if missing == 0 else FAIL
    return _item(
        "Observability",
        criterion,
        status,
        f"{checks['ok'] - missing} of {checks['ok']} successful events carry all four",
    )


def _admission(admission: Mapping[str, Any]) -> ChecklistItem:
    criterion = "per-team queue isolated, rejection events logged"
    teams = admission["teams"]
    if not teams:
        return _item("Admission control", criterion, NOT_MEASURED, "no team on any event")
    rejected = sum(t["rejected"] for t in teams)
    if not rejected:
        return _item(
            "Admission control",
            criterion,
            NOT_MEASURED,
            f"{len(teams)} team(s), no rejection in this run",
        )
    unlabelled = sum(t["rejected_without_reason"] for t in teams)
    spared = [t["team"] for t in teams if t["rejected"] == 0 and t["failed"] == 0 and t["ok"]]
    hit = [t["team"] for t in teams if t["rejected"]]
    status = PASS if spared and unlabelled == 0 else FAIL
    evidence = (
        f"{rejected} rejection events ({unlabelled} without a reason) for "
        f"{', '.join(map(str, hit))}; served without rejection or error: "
        f"{', '.join(map(str, spared)) or 'no team'}"
    )
    return _item("Admission control", criterion, status, evidence)


class Checks(TypedDict):
    """A slice's counts the pass criteria read (`sql.SLICE_CHECKS`, `sql.SLICE_OOMS`)."""

    requests: int
    timeouts: int
    ok: int
    ok_missing_fields: int  # successful events without model, tokens or e2e
    chat_requests: int
    chat_ok: int
    ooms: int


def _checks(con: duckdb.DuckDBPyConnection, params: Mapping[str, object], part: Slice) -> Checks:
    # Both are aggregates without GROUP BY: one row each, its columns named as Checks' keys.
    counts = row(con.execute(sql.SLICE_CHECKS, params)) or {}
    ooms = row(con.execute(sql.SLICE_OOMS, part.params())) or {}
    return picked(Checks, {**counts, **ooms})


def checklist(
    con: duckdb.DuckDBPyConnection,
    part: Slice,
    meta: Mapping[str, Any],
    summary: Mapping[str, Any],
    options: ReportOptions,
) -> list[ChecklistItem]:
    params = {**part.params(), "chat_workloads": _chat_workloads(meta.get("workload"))}
    checks = _checks(con, params, part)
    return [
        _loading(meta),
        _compatibility(checks),
        _stability(checks),
        _cost(summary["overall"], options),
        _observability(checks),
        _item(
            "Security",
            "external network/file access permissions separated",
            NOT_MEASURABLE,
            "a run records traffic, not access permissions: review the server's network "
            "policy, volume mounts and API keys",
        ),
        _admission(summary["admission"]),
    ]
