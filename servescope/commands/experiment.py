"""`servescope experiment`: lever-flip experiments (a seeded workload, two or more server
profiles, repeats interleaved A B B A …) and their pooled before/after reports."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from servescope.commands import bench
from servescope.commands.common import (
    UsageError,
    add_slo_option,
    console,
    open_store,
    sigterm_as_ctrl_c,
    store_command,
)
from servescope.loadgen.experiment import (
    Comparison,
    Experiment,
    ExperimentError,
    ExperimentHooks,
    ExperimentResult,
    ExperimentRun,
    ExperimentSpec,
    load_experiments,
    order_letters,
)
from servescope.loadgen.fleet import FleetExperiment
from servescope.loadgen.launcher import Profile, ProfileError, VllmServer, load_profiles
from servescope.loadgen.rounds import Look, Stopping
from servescope.loadgen.sidecar import CollectorSidecar
from servescope.loadgen.tiny_model import KINDS, is_built, make_tiny_model, model_dir
from servescope.loadgen.workload import BenchConfig, WorkloadError
from servescope.reports import (
    ReportOptions,
    build_diff,
    build_summary,
    sequential,
    write_report,
)
from servescope.reports.document import Report
from servescope.reports.judge import WHOLE_RUN
from servescope.reports.verdict import IMPROVED, REGRESSED, UNCHANGED
from servescope.store import Store, settings


def register(sub: argparse._SubParsersAction) -> None:
    experiments = load_experiments()
    parser = sub.add_parser(
        "experiment",
        help="lever-flip experiments: one workload, several server profiles, before/after",
    )
    commands = parser.add_subparsers(dest="experiment_command", required=True, metavar="SUBCOMMAND")
    listing = commands.add_parser("list", help="the built-in experiments (and those of --file)")
    _add_files(listing)
    listing.set_defaults(func=run_list)
    run = commands.add_parser(
        "run",
        help="run an experiment and build its reports",
        description="Run one seeded workload against each profile (arm) of the experiment, "
        "each arm `repeats` times (the experiment's own count, 3 unless it says otherwise), "
        "interleaved A B B A A B … so that a drift of the machine lands on every arm alike. "
        "On a CPU every arm's vLLM starts once (all at once, about 80-150 s), each with its own "
        "port, log and collector sidecar, and every run begins with the arm's prefix cache "
        "reset; on a GPU each arm's vLLM starts once, one after the other, and sleeps while "
        "another arm runs (woken, its prefix cache reset, for its own runs); --fresh-servers "
        "starts a fresh vLLM per run. Each run is "
        "stored with its levers and notes (repeat_design, repeat_state), a lever_flips row at "
        "each switch of arm. Then one pooled report per pair of consecutive arms (its "
        "repeats pooled) and one per repeat are written, their paths printed, pooled first. "
        "Built in: "
        + "; ".join(f"{n}: {e.description}" for n, e in experiments.items())
        + ". Exit codes: 0 ok; 1 a server failed, requests failed or Ctrl-C (what was measured "
        "is stored, the run marked partial); 2 an unknown experiment, a bad file or option.",
    )
    run.add_argument("name", metavar="NAME", help=f"one of {', '.join(experiments)}, or of --file")
    _add_files(run)
    run.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="a fixed design: exactly this many runs per arm, interleaved A B B A … (default: "
        "the experiment's `repeats` if it has one, else repeats until the primary indicator is "
        "decided, see --max-repeats, --budget, --margin)",
    )
    run.add_argument(
        "--max-repeats",
        type=int,
        default=sequential.MAX_REPEATS,
        help="a sequential design stops undecided after this many runs per arm "
        f"(default {sequential.MAX_REPEATS}; it first looks after {sequential.FIRST_LOOK})",
    )
    run.add_argument(
        "--budget",
        type=parse_duration,
        default=DEFAULT_BUDGET_S,
        metavar="TIME",
        help="a sequential design starts no round that would end after this time from the "
        f"experiment's start, servers' start included: 480, 480s, 8m (default "
        f"{DEFAULT_BUDGET_S / 60:g}m)",
    )
    run.add_argument(
        "--margin",
        type=float,
        default=sequential.MARGIN_PCT,
        metavar="PCT",
        help="unchanged means: the primary's interval lies within ±PCT %% "
        f"(default {sequential.MARGIN_PCT:g})",
    )
    run.add_argument(
        "--fresh-servers",
        action="store_true",
        help="start a fresh vLLM for every run instead of one per arm kept up (on a GPU: "
        "kept up asleep in turn)",
    )
    run.add_argument("--scale", type=float, default=None, help="prompt size factor override")
    run.add_argument("--requests", type=int, default=None, help="requests per level override")
    add_slo_option(run, "ttft_ms=…,tpot_ms=…,e2e_ms=…", "goodput bounds in ms, e.g. ttft_ms=500")
    run.add_argument(
        "--target",
        action="append",
        default=None,
        metavar="ARM=URL",
        help="use a running server for an arm (a profile's name; `default-a` in an A/A "
        "experiment) instead of launching one; its prefix cache is reset before each run "
        "where it runs with VLLM_SERVER_DEV_MODE=1, else the runs say they started warm",
    )
    run.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="a vLLM flag added to every server the experiment starts, after the profile's "
        "(so it wins), recorded in the runs' levers; repeatable, written with '=': "
        "--server-arg=--max-model-len=4096",
    )
    run.add_argument(
        "--model",
        type=Path,
        default=None,
        help="model dir (default: the experiment's `model`: a tiny model kind, "
        + ", ".join(f"{k} {model_dir(k)}" for k in KINDS)
        + ", built when missing; or a folder)",
    )
    run.add_argument(
        "--out",
        type=Path,
        default=settings.reports_dir(),
        help=f"(default {settings.reports_dir()})",
    )
    store_command(run, run_experiment, json_help="print the outcome as JSON")


DEFAULT_BUDGET_S = 480.0  # 8 minutes: a decided experiment fits a 9-minute job with its reports


def parse_duration(text: str) -> float:
    """A budget as typed: seconds (`480`, `480s`) or minutes (`8m`)."""
    number, unit = (text[:-1], text[-1]) if text[-1:] in ("s", "m") else (text, "s")
    try:
        value = float(number) * (60.0 if unit == "m" else 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration: give seconds (480, 480s) or minutes (8m)"
        ) from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"the budget must be positive, got {text!r}")
    return value


def _add_files(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--file",
        type=Path,
        default=None,
        metavar="EXPERIMENTS.yaml",
        help="your own experiments, in the format of the built-in loadgen/experiments.yaml "
        "(added to the built-in ones; yours win a name they share)",
    )
    parser.add_argument(
        "--profiles",
        type=Path,
        default=None,
        metavar="PROFILES.yaml",
        help="your own server profiles, in the format of loadgen/profiles.yaml (added to the "
        "built-in ones, which they may extend)",
    )


def _load(args: argparse.Namespace) -> tuple[dict[str, ExperimentSpec], dict[str, Profile]]:
    """The experiments and profiles, with the user's files; a file that cannot be used is a
    usage error (its one line, exit 2)."""
    try:
        return load_experiments(args.file), load_profiles(args.profiles)
    except (ExperimentError, ProfileError) as exc:
        raise UsageError(str(exc)) from None


def run_list(args: argparse.Namespace) -> int:
    experiments, _profiles = _load(args)
    for name, spec in experiments.items():
        origin = "" if spec.source == "built-in" else f" [{spec.source}]"
        repeats = f"{spec.repeats} repeats" if spec.repeats else "repeats until decided"
        print(
            f"{name}: {spec.workload} x {' vs '.join(spec.profiles)}, {repeats}"
            f"{origin} — {spec.description}"
        )
    return 0


def _targets(pairs: list[str] | None) -> dict[str, str] | None:
    if not pairs:
        return None
    targets = {}
    for pair in pairs:
        profile, sep, url = pair.partition("=")
        if not sep or not url:
            raise ValueError(f"--target takes ARM=URL, got {pair!r}")
        targets[profile] = url
    return targets


def _model(spec: ExperimentSpec, given: Path | None) -> tuple[Path, bool]:
    """The model folder the servers load, and whether it is the user's (never built)."""
    if given is not None:
        return given, True
    if spec.model in KINDS:
        return model_dir(spec.model), False
    return Path(spec.model), True


def run_experiment(args: argparse.Namespace) -> int:
    experiments, profiles = _load(args)
    if args.name not in experiments:
        where = f" or in {args.file}" if args.file else ""
        console.print(
            f"unknown experiment {args.name!r}; built in{where}: {', '.join(experiments)}",
            style="red",
            markup=False,
            soft_wrap=True,
        )
        return 2
    spec = experiments[args.name]
    model, given = _model(spec, args.model)
    store = open_store(args, create=True)
    experiment: Experiment | FleetExperiment
    try:
        if args.repeats is not None and args.repeats < 1:
            raise ValueError(f"--repeats must be positive, got {args.repeats}")
        if args.max_repeats < sequential.FIRST_LOOK:
            raise ValueError(
                f"--max-repeats must be at least {sequential.FIRST_LOOK} (the first look), got "
                f"{args.max_repeats}"
            )
        if not 0 < args.margin < 100:
            raise ValueError(f"--margin is a percentage between 0 and 100, got {args.margin}")
        stopping = Stopping(sequential.FIRST_LOOK, args.max_repeats, args.budget, args.margin)
        if spec.fleet is not None:
            if args.target:
                raise ValueError(
                    f"experiment {spec.name} starts its own replicas behind a gateway: "
                    "--target is not for it"
                )
            experiment = FleetExperiment(
                spec,
                store=store,
                execute=execute,
                model=model,
                repeats=args.repeats,
                scale=args.scale,
                requests=args.requests,
                slo=args.slo,
                hooks=hooks(store, stopping),
                profiles=profiles,
                stopping=stopping,
            )
        else:
            experiment = Experiment(
                spec,
                store=store,
                execute=execute,
                model=model,
                targets=_targets(args.target),
                repeats=args.repeats,
                scale=args.scale,
                requests=args.requests,
                slo=args.slo,
                hooks=hooks(store, stopping),
                server_flags=args.server_arg,
                profiles=profiles,
                fresh_servers=args.fresh_servers,
                stopping=stopping,
            )
    except (WorkloadError, ValueError) as exc:
        console.print(f"{exc}", style="red", markup=False, soft_wrap=True)
        return 2
    if not args.target and not ready_model(model, spec.model, given=given):
        console.print(
            f"experiment {args.name}: no model folder at {model}",
            style="red",
            markup=False,
            soft_wrap=True,
        )
        return 2
    console.print(Text.assemble((spec.name, "bold"), f": {plan_line(experiment)}"))
    sigterm_as_ctrl_c()
    result = experiment.run()
    reports = build_reports(store, result, args.out, experiment.stopping)
    rows = outcome_rows(store, result, reports)
    show_outcome(result, rows, reports)
    if args.json:
        print(json.dumps({**_outcome(result), "runs": rows, **reports.as_json()}))
    else:
        for path in reports.paths():
            print(path.resolve())
    if result.status != "complete":
        console.print(
            f"experiment {result.status}: {result.failure or 'interrupted'}",
            style="red",
            markup=False,
            soft_wrap=True,
        )
        return 1
    if reports.failures:
        return 1
    failed = sum(r.result.errors for r in result.runs if r.result)
    if failed:
        console.print(f"{failed} requests failed; see the reports' error classes", style="red")
        return 1
    return 0


def ready_model(model: Path, kind: str, *, given: bool) -> bool:
    """Whether the servers have a model folder to load. Only the default folder of a tiny model
    is built when missing: a folder the user names is theirs (an 8B config served with
    `--load-format dummy` has no weights and must stay as it is)."""
    if given:
        return (model / "config.json").is_file()
    if not is_built(model):
        with console.status(f"building the {kind} tiny model in {model}"):
            make_tiny_model(model, kind=kind)
    return True


def hooks(store: Store, stopping: Stopping | None = None) -> ExperimentHooks:
    """The display, the collector as the sidecar of every server an experiment starts, and
    the stopping rule's look at the evidence (the pooled comparisons built from the store)."""
    return ExperimentHooks(
        starting=starting,
        ready=ready,
        slept=slept,
        woke=woke,
        looked=looked,
        sidecar=lambda log, url: CollectorSidecar(store, log, url, notice=_notice),
        judge=judge(store, stopping) if stopping is not None else None,
    )


def plan_of(stopping: Stopping) -> sequential.Plan:
    return sequential.Plan(stopping.first, stopping.last, stopping.margin_pct)


def judge(store: Store, stopping: Stopping) -> Callable[[ExperimentResult], Look]:
    """Read the evidence so far: every pooled comparison's decision (reports/sequential.py),
    the same `build_diff` the final reports use, without its charts."""
    options = ReportOptions(charts=False, plan=plan_of(stopping))

    def look(result: ExperimentResult) -> Look:
        words, decided, shares = [], True, []
        for comparison in result.comparisons():
            after, before = _ids(comparison.after_runs), _ids(comparison.before_runs)
            report = build_diff(store, after, before, options)
            decision = report["decision"]
            decided = decided and decision["verdict"] in (IMPROVED, REGRESSED, UNCHANGED)
            words.append(f"{comparison.before} → {comparison.after}: {decision['words']}")
            lead = next((r for r in report["diff"] if r["role"] == "primary"), None)
            test = lead["test"] if lead is not None else None
            if test is not None and (share := test.get("request_share")) is not None:
                shares.append(share)
        return Look(decided, words, max(shares) if shares else None)

    return look


def looked(done: int, look: Look) -> None:
    for line in look.words:
        console.print(Text(f"look after {done} repeats a side: {line}", style="cyan"))


def execute(config: BenchConfig, target: str, store: Store, options: dict[str, Any]) -> Any:
    return bench.execute(config, target, store, **options)


def _notice(message: str, warning: bool = False) -> None:
    console.print(message, style="yellow" if warning else None)


def starting(profile: str, server: VllmServer) -> None:
    console.print(
        Text.assemble(
            "starting vLLM ", (profile, "bold"), f" on {server.url} (log {server.log_path})"
        )
    )


def ready(profile: str, server: VllmServer) -> None:
    console.print(f"vLLM {profile} ready after {server.ready_s:.0f} s")


def slept(arm: str, seconds: float) -> None:
    console.print(f"vLLM {arm} asleep after {seconds:.1f} s")


def woke(arm: str, seconds: float) -> None:
    console.print(f"vLLM {arm} awake after {seconds:.1f} s")


def plan_line(experiment: Experiment | FleetExperiment) -> str:
    """E.g. "repeats of no-prefix-caching, default in the order A B B A …, until TTFT is
    decided (first look after 3 a side, at most 20, budget 480 s, margin ±10 %); servers kept
    up: one server per arm, all up at once, rounds alternated"."""
    arms = experiment.spec.arms if isinstance(experiment, Experiment) else experiment.spec.profiles
    stopping = experiment.stopping
    if stopping is None:
        repeats = experiment.repeats
        how = (
            f"{repeats} repeat{'s' if repeats != 1 else ''} of {', '.join(arms)} in the order "
            f"{order_letters(arms, repeats)}"
        )
    else:
        budget = f", budget {stopping.budget_s:.0f} s" if stopping.budget_s else ""
        how = (
            f"repeats of {', '.join(arms)} in the order {order_letters(arms, 2)} …, until the "
            f"primary indicator is decided (first look after {stopping.first} a side, at most "
            f"{stopping.last}{budget}, unchanged within ±{stopping.margin_pct:g} %)"
        )
    return f"{how}; {experiment.design}"


@dataclass
class Built:
    """One written report: the dict, its HTML page, and the runs it compares or summarises."""

    report: Report
    page: Path
    before: list[str] = field(default_factory=list)
    after: list[str] = field(default_factory=list)
    label: str = ""


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

    def as_json(self) -> dict[str, Any]:
        return {
            "reports": [str(b.page) for b in self.pooled + self.summaries],
            "repeat_reports": [str(b.page) for b in self.repeats],
            "verdicts": [
                {
                    "before": b.before,
                    "after": b.after,
                    "report": str(b.page),
                    "headline": b.report.get("headline"),
                    "rows": verdict_rows(b.report),
                }
                for b in self.pooled
            ],
            "report_failures": self.failures,
        }


def _write(report: Report, out: Path) -> Path:
    written = write_report(report, out)
    return next(p for p in written if p.name == "index.html")


def _ids(runs: list[ExperimentRun]) -> str | list[str]:
    """One run's id as a string (a plain diff), several as a list (their repeats pooled)."""
    ids = [run.run_id for run in runs]
    return ids[0] if len(ids) == 1 else ids


def build_reports(
    store: Store, result: ExperimentResult, out: Path, stopping: Stopping | None = None
) -> ExperimentReports:
    """The pooled before/after report of every pair of consecutive arms (`build_diff` with
    each arm's runs), the per-repeat reports beside it when an arm ran more than once, and the
    summary of every run no pair holds (an experiment stopped after its first run). A report
    that fails to build is one line in `failures`, never the end of the others."""
    reports = ExperimentReports()
    comparisons: list[Comparison] = result.comparisons()
    for comparison in comparisons:
        after, before = _ids(comparison.after_runs), _ids(comparison.before_runs)
        label = f"{comparison.before} → {comparison.after}"
        options = ReportOptions(
            plan=plan_of(stopping) if stopping is not None else None,
            stopped=(result.stopped, result.stop_words) if result.stopped else None,
        )
        try:
            report = build_diff(store, after, before, options)
        except Exception as exc:  # the other reports still come
            reports.failures.append(f"pooled report {label}: {type(exc).__name__}: {exc}")
            continue
        reports.pooled.append(
            Built(
                report,
                _write(report, out),
                [r.run_id for r in comparison.before_runs],
                [r.run_id for r in comparison.after_runs],
                label,
            )
        )
    pooled = {c.before: c for c in comparisons}
    for before_run, after_run in result.pairs():
        comparison = pooled[before_run.arm]
        if len(comparison.before_runs) == len(comparison.after_runs) == 1:
            continue  # the pooled report is this one
        label = f"{before_run.arm} → {after_run.arm} r{after_run.repeat}"
        try:
            report = build_diff(store, after_run.run_id, before_run.run_id)
        except Exception as exc:
            reports.failures.append(f"report {label}: {type(exc).__name__}: {exc}")
            continue
        reports.repeats.append(
            Built(report, _write(report, out), [before_run.run_id], [after_run.run_id], label)
        )
    paired = {run.run_id for c in comparisons for run in c.before_runs + c.after_runs}
    for run in result.runs:
        if run.run_id in paired or not store.has_run(run.run_id):
            continue
        report = build_summary(store, run.run_id)
        reports.summaries.append(Built(report, _write(report, out), [], [run.run_id], run.arm))
    for failure in reports.failures:
        console.print(failure, style="red", markup=False, soft_wrap=True)
    return reports


# -- the console: one computation with the reports ------------------------------------------


def _run_sides(reports: ExperimentReports | None) -> dict[str, Mapping[str, Any]]:
    """Each run's own summary (overall, groups, server) as the reports computed it: a plain
    diff's before and after, a summary report."""
    sides: dict[str, Mapping[str, Any]] = {}
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


def _probe(groups: Sequence[Mapping[str, Any]]) -> float | None:
    """The probes' TTFT p50 (a workload with a `probe` request class stores them as
    `<workload>:probe`); None where the workload has no probes."""
    probes = [g for g in groups if str(g.get("workload") or "").endswith(":probe")]
    if len(probes) != 1:
        return None
    return (probes[0].get("ttft_ms") or {}).get("p50")


def outcome_rows(
    store: Store, result: ExperimentResult, reports: ExperimentReports | None = None
) -> list[dict[str, Any]]:
    """One row per run: the indicators the experiment is about, taken from the run's report
    summary (`build_summary`, or the same numbers inside a per-repeat report), so that the
    console and the reports never disagree."""
    sides = _run_sides(reports)
    options = ReportOptions(charts=False)
    rows = []
    for run in result.runs:
        if run.result is None or not store.has_run(run.run_id):
            continue
        side = sides.get(run.run_id) or build_summary(store, run.run_id, options)
        overall, server = side["overall"], side.get("server") or {}
        spec = server.get("spec_decode") or {}
        rows.append(
            {
                "run_id": run.run_id,
                "arm": run.arm,
                "profile": run.profile,
                "repeat": run.repeat,
                "status": run.result.status,
                "requests": overall["requests"],
                "errors": overall["errors"],
                "ttft_source": (overall.get("sources") or {}).get("ttft_ms"),
                "ttft_ms_p50": overall["ttft_ms"]["p50"],
                "ttft_ms_p95": overall["ttft_ms"]["p95"],
                "probe_ttft_ms_p50": _probe(side.get("groups") or []),
                "has_probes": any(
                    str(g.get("workload") or "").endswith(":probe")
                    for g in side.get("groups") or []
                ),
                "tpot_ms_p50": overall["tpot_ms"]["p50"],
                "server_prefix_cache_hit_ratio": server.get("prefix_cache_hit_ratio"),
                "client_cached_token_ratio": overall.get("cached_token_ratio"),
                "preemptions": server.get("preemptions"),
                "spec_decode_acceptance_rate": spec.get("acceptance_rate"),
                "speculative": "speculative_config" in (run.levers or {}),
                "server_ready_s": run.server_ready_s,
                "repeat_state": run.notes.get("repeat_state"),
            }
        )
    return rows


# The indicators of the outcome table: (heading, outcome_rows key, format, diff row metric)
OUTCOME_INDICATORS: list[tuple[str, str, str]] = [
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


def shown_indicators(rows: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
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


NOTES = {
    "server_prefix_cache_hit_ratio": "server hit ratio: Δhits/Δqueries",
    "client_cached_token_ratio": "client cached ratio: cached_tokens/prompt_tokens",
    "spec_decode_acceptance_rate": "draft acceptance: accepted/draft tokens",
}


def _note(rows: list[dict[str, Any]], indicators: list[tuple[str, str, str]]) -> str:
    """What the figures are: whose TTFT (the client's, or vLLM's where the client had none),
    and how the ratios shown are computed."""
    sources = sorted({r["ttft_source"] for r in rows if r.get("ttft_source")})
    parts = [f"TTFT: {' and '.join(sources)} side"] if sources else []
    parts += [NOTES[key] for _h, key, _f in indicators if key in NOTES]
    return "; ".join(parts)


def outcome_table(
    rows: list[dict[str, Any]],
    console: Console,
    indicators: list[tuple[str, str, str]] | None = None,
) -> RenderableType:
    """The runs' indicators: one line per run where the console is wide enough for every
    indicator side by side, else one column per run (as many runs a table as fit), so that a
    pipe or an 80-column terminal shows every heading and figure whole."""
    indicators = shown_indicators(rows) if indicators is None else indicators
    note = _note(rows, indicators)
    wide = _runs_by_row(rows, indicators, note)
    unbounded = console.options.update_width(1 << 16)
    if console.measure(wide, options=unbounded).maximum <= console.width:
        return wide
    labels = _run_labels(rows)
    heading = max(len(h) for h, _k, _f in indicators)
    per_run = max([len(label) for label in labels] + [len("100.0%")]) + 3  # cell + borders
    fit = max(1, (console.width - heading - 4) // per_run)
    tables: list[RenderableType] = [
        _runs_by_column(rows[i : i + fit], labels[i : i + fit], indicators)
        for i in range(0, len(rows), fit)
    ]
    return Group(*tables, Text(note, style="dim"))


def _cell(row: dict[str, Any], key: str, spec: str) -> str:
    value = row.get(key)
    return "n/a" if value is None else format(value, spec)


def _runs_by_row(
    rows: list[dict[str, Any]], indicators: list[tuple[str, str, str]], note: str
) -> Table:
    table = Table("run", *(h for h, _k, _f in indicators), title=f"runs ({note})")
    for row, label in zip(rows, _run_labels(rows), strict=True):
        table.add_row(label, *(_cell(row, k, f) for _h, k, f in indicators))
    return table


def _runs_by_column(
    rows: list[dict[str, Any]], labels: list[str], indicators: list[tuple[str, str, str]]
) -> Table:
    table = Table("run", *labels, title="runs")
    for column in table.columns[1:]:
        column.justify = "right"
    for heading, key, spec in indicators:
        table.add_row(heading, *(_cell(row, key, spec) for row in rows))
    return table


def _run_labels(rows: list[dict[str, Any]]) -> list[str]:
    """Each run's arm, with its repeat when an arm ran more than once."""
    arms = [r.get("arm") or r["profile"] for r in rows]
    repeated = len(set(arms)) < len(rows)
    return [f"{a} r{r['repeat']}" if repeated else a for a, r in zip(arms, rows, strict=True)]


# -- the pooled verdicts ----------------------------------------------------------------------


def _is_probe_level(level: Any) -> bool:
    return ":probe" in str(level or "")


def primary_level(report: Mapping[str, Any]) -> str:
    """The load level the pooled report's verdict is gated on (its primary indicator's)."""
    return str((report.get("primary") or {}).get("level") or WHOLE_RUN)


def verdict_rows(report: Mapping[str, Any], keys: list[str] | None = None) -> list[dict[str, Any]]:
    """The pooled report's own diff rows for the outcome table's indicators (the same numbers
    the report shows): at the primary indicator's load level, a whole-run row where the
    indicator has no per-level one (a server counter), the probes' level for the probe TTFT.
    Rows neither side measured are left out."""
    rows = report.get("diff") or []
    level = primary_level(report)
    out = []
    for key in keys or list(POOLED_METRICS):
        metric = POOLED_METRICS[key]
        candidates = [r for r in rows if r.get("metric") == metric]
        if key == "probe_ttft_ms_p50":
            if _is_probe_level(level):
                continue  # the TTFT row is the probes' already
            found = [r for r in candidates if _is_probe_level(r.get("level"))]
        else:
            found = [r for r in candidates if r.get("level", WHOLE_RUN) == level]
            found = found or [r for r in candidates if r.get("level", WHOLE_RUN) == WHOLE_RUN]
        if len(found) == 1 and (
            found[0].get("before") is not None or found[0].get("after") is not None
        ):
            out.append({"key": key, **found[0]})
    return out


def _signed(value: float) -> str:
    return f"{'−' if value < 0 else '+'}{abs(value):.0f}"


def _change(row: dict[str, Any]) -> str:
    """Δ % with the interval its verdict reads, e.g. "−81 % (−83…−78)"."""
    if row.get("delta_pct") is None:
        return "n/a"
    ci = row.get("ci95_pct")
    interval = f" ({_signed(ci[0])}…{_signed(ci[1])})" if ci else ""
    return f"{_signed(row['delta_pct'])} %{interval}"


def verdict_table(built: Built, indicators: list[tuple[str, str, str]]) -> Table:
    """One pooled comparison at its primary level: before and after (the repeats pooled),
    Δ % with the interval its verdict reads (the primary's: the stopping rule's; the others':
    their correction's) and the verdict, row by row from the pooled report."""
    repeats = built.report.get("repeats")
    k_before = repeats["before"] if repeats else len(built.before)
    k_after = repeats["after"] if repeats else len(built.after)
    table = Table(
        "indicator",
        "before",
        "after",
        "Δ (interval)",
        "verdict",
        title=f"{built.label} at {primary_level(built.report)}: {k_before} vs {k_after} "
        "runs pooled (* the primary indicator)",
    )
    for column in table.columns[1:4]:
        column.justify = "right"
    specs = {key: (heading, spec) for heading, key, spec in indicators}
    for row in verdict_rows(built.report, [k for k in POOLED_METRICS if k in specs]):
        heading, spec = specs[row["key"]]
        table.add_row(
            heading + (" *" if row.get("role") == "primary" else ""),
            _cell(row, "before", spec),
            _cell(row, "after", spec),
            _change(row),
            str(row.get("verdict") or ""),
        )
    return table


def show_outcome(
    result: ExperimentResult, rows: list[dict[str, Any]], reports: ExperimentReports
) -> None:
    """The runs' table, then per pooled comparison its verdict table and headline."""
    indicators = shown_indicators(rows)
    console.print(outcome_table(rows, console, indicators))
    states = sorted({str(r["repeat_state"]) for r in rows if r.get("repeat_state")})
    if result.design or states:
        console.print(
            Text(
                f"order {result.order}; {result.design}; each run started: {', '.join(states)}",
                style="dim",
            )
        )
    if result.stop_words:
        console.print(Text(f"stopped: {result.stop_words}", style="bold"))
    if result.sizing:
        console.print(Text(f"runs: {result.sizing}", style="dim"))
    for built in reports.pooled:
        console.print(verdict_table(built, indicators))
        if built.report.get("headline"):
            console.print(Text(built.report["headline"]), markup=False)


def _outcome(result: ExperimentResult) -> dict[str, Any]:
    return {
        "experiment": result.name,
        "experiment_id": result.experiment_id,
        "status": result.status,
        "failure": result.failure,
        "design": result.design,
        "order": result.order,
        "stopped": result.stopped,
        "stop_words": result.stop_words,
        "sizing": result.sizing,
        "looks": [{"decided": look.decided, "words": look.words} for look in result.looks],
    }
