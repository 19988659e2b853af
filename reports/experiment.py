"""An experiment's reports, fed its arms' run ids: the pooled before/after report of every pair
of consecutive arms (their repeats pooled), one report per repeat of each pair beside it, the
summary of a run no pair holds; the stopping rule's look at the evidence so far; and the
figures the console shows of them (reports/outcome.py draws them), taken from the reports
themselves so that the console and the reports never disagree.

The reports room knows runs by their ids, never by the load generator's objects: the command
that ran the experiment says which runs each arm has (`Arms`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

import duckdb

from servescope.reports.build import build_diff, build_summary
from servescope.reports.document import DiffRow, Group, Numbers, Report
from servescope.reports.judge import WHOLE_RUN
from servescope.reports.render import write_report
from servescope.reports.sequential import Plan
from servescope.reports.summary import ReportOptions
from servescope.reports.verdict import IMPROVED, REGRESSED, UNCHANGED
from servescope.store import Store

# What a report of an experiment may fail with (a run stored partly, a figure with nothing to
# compute it from, a folder that cannot be written): one line in `failures`, the others still come
REPORT_FAILURES = (LookupError, ValueError, ArithmeticError, duckdb.Error, OSError)


@dataclass(frozen=True)
class ArmRun:
    """One run of an arm, as the command that ran it knows it: its id, its arm (the profile's
    name, or `<profile>-a` in an A/A experiment), its repeat, and what its bench run said."""

    run_id: str
    arm: str
    profile: str
    repeat: int
    status: str | None = None  # the bench run's: complete | partial | failed; None: not run
    speculative: bool = False  # the arm's levers speculate (--speculative-config)
    server_ready_s: float | None = None
    repeat_state: str | None = None  # how the run started (reset, warm, fresh …)


@dataclass(frozen=True)
class ArmPair:
    """Two consecutive arms of the experiment and the measured runs of each, in run order."""

    before: str
    after: str
    before_runs: list[ArmRun]
    after_runs: list[ArmRun]

    @property
    def label(self) -> str:
        return f"{self.before} → {self.after}"


@dataclass(frozen=True)
class Arms:
    """An experiment as its reports need it: every run in run order, the pairs of consecutive
    arms (pooled), the (before, after) runs of each pair within each repeat both arms ran in
    (a report each, beside the pooled one), and why the rounds stopped (the stopping rule's
    `stopped` and its words), if they stopped early. The experiment says which runs pair up
    (loadgen.experiment.ExperimentResult.comparisons and .pairs): the reports only read it."""

    runs: list[ArmRun]
    comparisons: list[ArmPair]
    repeats: list[tuple[ArmRun, ArmRun]] = field(default_factory=list)
    stopped: tuple[str, str] | None = None


def _ids(runs: Sequence[ArmRun]) -> str | list[str]:
    """One run's id as a string (a plain diff), several as a list (their repeats pooled)."""
    ids = [run.run_id for run in runs]
    return ids[0] if len(ids) == 1 else ids


# -- the stopping rule's look -----------------------------------------------------------------


@dataclass(frozen=True)
class Evidence:
    """What the pooled comparisons say so far: whether every one is decided, each one's
    decision in words, and the largest share of a primary's variance its requests make (what
    sizes the runs: loadgen/rounds.py)."""

    decided: bool
    words: list[str]
    request_share: float | None


def evidence(store: Store, comparisons: Sequence[ArmPair], plan: Plan) -> Evidence:
    """Every pooled comparison's decision (reports/sequential.py), from the same `build_diff`
    the final reports use, without its charts."""
    options = ReportOptions(charts=False, plan=plan)
    words, decided, shares = [], True, []
    for comparison in comparisons:
        report = build_diff(
            store, _ids(comparison.after_runs), _ids(comparison.before_runs), options
        )
        decision = report["decision"]
        decided = decided and decision["verdict"] in (IMPROVED, REGRESSED, UNCHANGED)
        words.append(f"{comparison.label}: {decision['words']}")
        lead = next((r for r in report["diff"] if r["role"] == "primary"), None)
        test = lead["test"] if lead is not None else None
        if test is not None and (share := test.get("request_share")) is not None:
            shares.append(share)
    return Evidence(decided, words, max(shares) if shares else None)


# -- the reports --------------------------------------------------------------------------------


@dataclass
class Built:
    """One written report: the report, its HTML page, and the runs it compares or summarises."""

    report: Report
    page: Path
    before: list[str] = field(default_factory=list)
    after: list[str] = field(default_factory=list)
    label: str = ""


class VerdictRow(DiffRow):
    """A pooled report's own diff row for one indicator of the outcome table (`key`)."""

    key: str


class Verdicts(TypedDict):
    """A pooled comparison in the experiment's `--json`."""

    before: list[str]
    after: list[str]
    report: str
    headline: str | None
    rows: list[VerdictRow]


class ReportsJson(TypedDict):
    reports: list[str]
    repeat_reports: list[str]
    verdicts: list[Verdicts]
    report_failures: list[str]


@dataclass
class ExperimentReports:
    """An experiment's reports: one pooled before/after per pair of consecutive arms, one per
    repeat of each pair (the detail), and the summary of a run no pair holds."""

    pooled: list[Built] = field(default_factory=list)
    repeats: list[Built] = field(default_factory=list)
    summaries: list[Built] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def paths(self) -> list[Path]:
        return [b.page for b in self.pooled + self.repeats + self.summaries]

    def as_json(self) -> ReportsJson:
        return ReportsJson(
            reports=[str(b.page) for b in self.pooled + self.summaries],
            repeat_reports=[str(b.page) for b in self.repeats],
            verdicts=[
                Verdicts(
                    before=b.before,
                    after=b.after,
                    report=str(b.page),
                    headline=b.report.get("headline"),
                    rows=verdict_rows(b.report),
                )
                for b in self.pooled
            ],
            report_failures=self.failures,
        )


def _write(report: Report, out: Path) -> Path:
    written = write_report(report, out)
    return next(p for p in written if p.name == "index.html")


def build_reports(
    store: Store, arms: Arms, out: Path, plan: Plan | None = None
) -> ExperimentReports:
    """The pooled before/after report of every pair of consecutive arms (`build_diff` with
    each arm's runs, judged by `plan`'s stopping rule), the per-repeat reports beside it when an
    arm ran more than once, and the summary of every run no pair holds (an experiment stopped
    after its first run). A report that fails to build is one line in `failures`, never the
    end of the others."""
    reports = ExperimentReports()
    _pooled(store, arms, out, plan, reports)
    _per_repeat(store, arms, out, reports)
    paired = {run.run_id for c in arms.comparisons for run in c.before_runs + c.after_runs}
    for run in arms.runs:
        if run.run_id in paired or not store.has_run(run.run_id):
            continue
        report = build_summary(store, run.run_id)
        reports.summaries.append(Built(report, _write(report, out), [], [run.run_id], run.arm))
    return reports


def _pooled(
    store: Store, arms: Arms, out: Path, plan: Plan | None, reports: ExperimentReports
) -> None:
    options = ReportOptions(plan=plan, stopped=arms.stopped)
    for comparison in arms.comparisons:
        after, before = _ids(comparison.after_runs), _ids(comparison.before_runs)
        try:
            report = build_diff(store, after, before, options)
        except REPORT_FAILURES as exc:
            reports.failures.append(
                f"pooled report {comparison.label}: {type(exc).__name__}: {exc}"
            )
            continue
        reports.pooled.append(
            Built(
                report,
                _write(report, out),
                [r.run_id for r in comparison.before_runs],
                [r.run_id for r in comparison.after_runs],
                comparison.label,
            )
        )


def _per_repeat(store: Store, arms: Arms, out: Path, reports: ExperimentReports) -> None:
    pooled = {c.before: c for c in arms.comparisons}
    for before_run, after_run in arms.repeats:
        comparison = pooled[before_run.arm]
        if len(comparison.before_runs) == len(comparison.after_runs) == 1:
            continue  # the pooled report is this one
        label = f"{before_run.arm} → {after_run.arm} r{after_run.repeat}"
        try:
            report = build_diff(store, after_run.run_id, before_run.run_id)
        except REPORT_FAILURES as exc:
            reports.failures.append(f"report {label}: {type(exc).__name__}: {exc}")
            continue
        reports.repeats.append(
            Built(report, _write(report, out), [before_run.run_id], [after_run.run_id], label)
        )


# -- the runs' figures: one computation with the reports ----------------------------------------


class OutcomeRow(TypedDict):
    """One run's line of the outcome table (and of `--json`'s `runs`)."""

    run_id: str
    arm: str
    profile: str
    repeat: int
    status: str | None
    requests: int
    errors: int
    ttft_source: str | None
    ttft_ms_p50: float | None
    ttft_ms_p95: float | None
    probe_ttft_ms_p50: float | None
    has_probes: bool
    tpot_ms_p50: float | None
    server_prefix_cache_hit_ratio: float | None
    client_cached_token_ratio: float | None
    preemptions: float | None
    spec_decode_acceptance_rate: float | None
    speculative: bool
    server_ready_s: float | None
    repeat_state: str | None


def _run_sides(reports: ExperimentReports | None) -> dict[str, Numbers]:
    """Each run's own numbers (overall, groups, server) as the reports computed them: a plain
    diff's before and after, a summary report."""
    sides: dict[str, Numbers] = {}
    if reports is None:
        return sides
    for built in reports.pooled + reports.repeats:
        if len(built.before) == len(built.after) == 1:
            for side in (built.report.get("before"), built.report.get("after")):
                if side is not None:
                    sides[side["run_id"]] = side
    for built in reports.summaries:
        sides[built.report["run_id"]] = built.report
    return sides


def _probes(groups: Sequence[Group]) -> list[Group]:
    """The probes' groups (a workload with a `probe` request class stores them as
    `<workload>:probe`)."""
    return [g for g in groups if str(g["workload"] or "").endswith(":probe")]


def outcome_rows(
    store: Store, arms: Arms, reports: ExperimentReports | None = None
) -> list[OutcomeRow]:
    """One row per measured run: the indicators the experiment is about, taken from the run's
    report summary (`build_summary`, or the same numbers inside a per-repeat report), so that
    the console and the reports never disagree."""
    sides = _run_sides(reports)
    options = ReportOptions(charts=False)
    rows = []
    for run in arms.runs:
        if run.status is None or not store.has_run(run.run_id):
            continue
        rows.append(
            _outcome_row(run, sides.get(run.run_id) or build_summary(store, run.run_id, options))
        )
    return rows


def _outcome_row(run: ArmRun, side: Numbers) -> OutcomeRow:
    overall, server = side["overall"], side["server"]
    spec = server["spec_decode"]
    probes = _probes(side["groups"])
    return OutcomeRow(
        run_id=run.run_id,
        arm=run.arm,
        profile=run.profile,
        repeat=run.repeat,
        status=run.status,
        requests=overall["requests"],
        errors=overall["errors"],
        ttft_source=overall["sources"].get("ttft_ms"),
        ttft_ms_p50=overall["ttft_ms"]["p50"],
        ttft_ms_p95=overall["ttft_ms"]["p95"],
        probe_ttft_ms_p50=probes[0]["ttft_ms"]["p50"] if len(probes) == 1 else None,
        has_probes=bool(probes),
        tpot_ms_p50=overall["tpot_ms"]["p50"],
        server_prefix_cache_hit_ratio=server["prefix_cache_hit_ratio"],
        client_cached_token_ratio=overall["cached_token_ratio"],
        preemptions=server["preemptions"],
        spec_decode_acceptance_rate=spec["acceptance_rate"] if spec else None,
        speculative=run.speculative,
        server_ready_s=run.server_ready_s,
        repeat_state=run.repeat_state,
    )


# One indicator of the outcome table: (heading, OutcomeRow key, format)
Shown = tuple[str, str, str]
OUTCOME_INDICATORS: list[Shown] = [
    ("requests", "requests", ""),
    ("errors", "errors", ""),
    ("TTFT p50 ms", "ttft_ms_p50", ".0f"),
    ("TTFT p95 ms", "ttft_ms_p95", ".0f"),
    ("probe TTFT p50 ms", "probe_ttft_ms_p50", ".0f"),
    ("server hit ratio", "server_prefix_cache_hit_ratio", ".1%"),
    ("client cached ratio", "client_cached_token_ratio", ".1%"),
    ("TPOT p50 ms", "tpot_ms_p50", ".1f"),
    ("draft acceptance", "spec_decode_acceptance_rate", ".1%"),
]
# the outcome table's indicator -> the pooled report's diff row (metric, a probe level or not)
POOLED_METRICS: dict[str, str] = {
    "ttft_ms_p50": "ttft_ms.p50",
    "ttft_ms_p95": "ttft_ms.p95",
    "probe_ttft_ms_p50": "ttft_ms.p50",
    "server_prefix_cache_hit_ratio": "server.prefix_cache_hit_ratio",
    "client_cached_token_ratio": "cached_token_ratio",
    "tpot_ms_p50": "tpot_ms.p50",
    "spec_decode_acceptance_rate": "server.spec_decode_acceptance_ratio",
}


def shown_indicators(rows: Sequence[Mapping[str, object]]) -> list[Shown]:
    """The indicators that mean something for these runs: no probe TTFT where the workload
    has no probe class, no draft acceptance where neither arm speculates."""
    probes = any(r.get("has_probes") or r.get("probe_ttft_ms_p50") is not None for r in rows)
    speculation = any(
        r.get("speculative") or r.get("spec_decode_acceptance_rate") is not None for r in rows
    )
    return [
        indicator
        for indicator in OUTCOME_INDICATORS
        if (indicator[1] != "probe_ttft_ms_p50" or probes)
        and (indicator[1] != "spec_decode_acceptance_rate" or speculation)
    ]


# -- the pooled verdicts ----------------------------------------------------------------------


def _is_probe_level(level: str) -> bool:
    return ":probe" in level


def primary_level(report: Report) -> str:
    """The load level the pooled report's verdict is gated on (its primary indicator's)."""
    primary = report.get("primary")
    return primary["level"] if primary and primary["level"] else WHOLE_RUN


def verdict_rows(report: Report, keys: list[str] | None = None) -> list[VerdictRow]:
    """The pooled report's own diff rows for the outcome table's indicators (the same numbers
    the report shows): at the primary indicator's load level, a whole-run row where the
    indicator has no per-level one (a server counter), the probes' level for the probe TTFT.
    Rows neither side measured are left out."""
    rows = report.get("diff") or []
    level = primary_level(report)
    out = []
    for key in keys or list(POOLED_METRICS):
        found = _rows_for(key, [r for r in rows if r["metric"] == POOLED_METRICS[key]], level)
        if len(found) == 1 and (found[0]["before"] is not None or found[0]["after"] is not None):
            out.append(VerdictRow(key=key, **found[0]))
    return out


def _rows_for(key: str, candidates: list[DiffRow], level: str) -> list[DiffRow]:
    if key == "probe_ttft_ms_p50":
        if _is_probe_level(level):
            return []  # the TTFT row is the probes' already
        return [r for r in candidates if _is_probe_level(r["level"])]
    found = [r for r in candidates if r["level"] == level]
    return found or [r for r in candidates if r["level"] == WHOLE_RUN]
