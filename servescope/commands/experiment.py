"""`servescope experiment`: lever-flip experiments (a seeded workload, two or more server
profiles, repeats interleaved A B B A …) and their pooled before/after reports."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

from rich.text import Text

from servescope.commands import bench
from servescope.commands.common import (
    UsageError,
    add_slo_option,
    command_group,
    console,
    open_store,
    sigterm_as_ctrl_c,
    store_command,
)
from servescope.loadgen.experiment import Experiment
from servescope.loadgen.fleet import FleetExperiment
from servescope.loadgen.launcher import Profile, ProfileError, VllmServer, load_profiles
from servescope.loadgen.rounds import Look, Stopping
from servescope.loadgen.runner import RunOptions, RunResult
from servescope.loadgen.sequence import (
    Comparison,
    ExperimentHooks,
    ExperimentOptions,
    ExperimentResult,
    ExperimentRun,
    order_letters,
)
from servescope.loadgen.sidecar import CollectorSidecar
from servescope.loadgen.spec import ExperimentError, ExperimentSpec, load_experiments
from servescope.loadgen.tiny_model import KINDS, is_built, make_tiny_model, model_dir
from servescope.loadgen.workload import BenchConfig, WorkloadError
from servescope.reports import sequential
from servescope.reports.experiment import (
    ArmPair,
    ArmRun,
    Arms,
    ExperimentReports,
    OutcomeRow,
    build_reports,
    evidence,
    outcome_rows,
    shown_indicators,
)
from servescope.reports.outcome import outcome_table, verdict_table
from servescope.store import Store, settings


# A declarative table (argparse set-up, one statement per option): longer than 80 lines by
# design, as the house rule allows.
def register(sub: argparse._SubParsersAction) -> None:
    experiments = load_experiments()
    commands = command_group(
        sub,
        "experiment",
        help="lever-flip experiments: one workload, several server profiles, before/after",
    )
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
        _error(f"unknown experiment {args.name!r}; built in{where}: {', '.join(experiments)}")
        return 2
    spec = experiments[args.name]
    model, given = _model(spec, args.model)
    store = open_store(args, create=True)
    try:
        experiment = _experiment(args, spec, store, model, profiles)
    except (WorkloadError, ValueError) as exc:
        _error(str(exc))
        return 2
    if not args.target and not ready_model(model, spec.model, given=given):
        _error(f"experiment {args.name}: no model folder at {model}")
        return 2
    console.print(Text.assemble((spec.name, "bold"), f": {plan_line(experiment)}"))
    sigterm_as_ctrl_c()
    result = experiment.run()
    reports, rows = conclude(store, result, args.out, experiment.stopping)
    if args.json:
        print(json.dumps({**_outcome(result), "runs": rows, **reports.as_json()}))
    else:
        for path in reports.paths():
            print(path.resolve())
    return _exit_code(result, reports)


def _error(message: str) -> None:
    console.print(message, style="red", markup=False, soft_wrap=True)


def _stopping(args: argparse.Namespace) -> Stopping:
    """The sequential design's stopping rule, from --max-repeats, --budget and --margin
    (ValueError: one out of its range)."""
    if args.repeats is not None and args.repeats < 1:
        raise ValueError(f"--repeats must be positive, got {args.repeats}")
    if args.max_repeats < sequential.FIRST_LOOK:
        raise ValueError(
            f"--max-repeats must be at least {sequential.FIRST_LOOK} (the first look), got "
            f"{args.max_repeats}"
        )
    if not 0 < args.margin < 100:
        raise ValueError(f"--margin is a percentage between 0 and 100, got {args.margin}")
    return Stopping(sequential.FIRST_LOOK, args.max_repeats, args.budget, args.margin)


def _experiment(
    args: argparse.Namespace,
    spec: ExperimentSpec,
    store: Store,
    model: Path,
    profiles: dict[str, Profile],
) -> Experiment | FleetExperiment:
    """The experiment the options describe: a fleet's behind its gateway, else one server per
    arm (ValueError, WorkloadError: options it cannot run with)."""
    stopping = _stopping(args)
    if spec.fleet is not None and args.target:
        raise ValueError(
            f"experiment {spec.name} starts its own replicas behind a gateway: --target is "
            "not for it"
        )
    options = ExperimentOptions(
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
    if spec.fleet is not None:
        return FleetExperiment(spec, **options)
    return Experiment(
        spec,
        targets=_targets(args.target),
        server_flags=args.server_arg,
        fresh_servers=args.fresh_servers,
        **options,
    )


def _exit_code(result: ExperimentResult, reports: ExperimentReports) -> int:
    """1 when the experiment stopped short, a report failed or requests failed; else 0."""
    if result.status != "complete":
        _error(f"experiment {result.status}: {result.failure or 'interrupted'}")
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
    """Read the evidence so far: every pooled comparison's decision (reports/experiment.py),
    under the stopping rule's plan."""

    def look(result: ExperimentResult) -> Look:
        found = evidence(store, arms_of(result).comparisons, plan_of(stopping))
        return Look(found.decided, found.words, found.request_share)

    return look


def looked(done: int, look: Look) -> None:
    for line in look.words:
        console.print(Text(f"look after {done} repeats a side: {line}", style="cyan"))


def execute(config: BenchConfig, target: str, store: Store, options: RunOptions) -> RunResult:
    return bench.execute(config, target, store, options)


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


# -- the reports: the experiment's runs by arm, built and shown --------------------------------


def _arm_run(run: ExperimentRun) -> ArmRun:
    state = run.notes.get("repeat_state")
    return ArmRun(
        run_id=run.run_id,
        arm=run.arm,
        profile=run.profile,
        repeat=run.repeat,
        status=run.result.status if run.result is not None else None,
        speculative="speculative_config" in (run.levers or {}),
        server_ready_s=run.server_ready_s,
        repeat_state=None if state is None else str(state),
    )


def _arm_pair(comparison: Comparison) -> ArmPair:
    return ArmPair(
        comparison.before,
        comparison.after,
        [_arm_run(r) for r in comparison.before_runs],
        [_arm_run(r) for r in comparison.after_runs],
    )


def arms_of(result: ExperimentResult) -> Arms:
    """The experiment's runs as the reports take them: by arm, with their ids."""
    return Arms(
        runs=[_arm_run(run) for run in result.runs],
        comparisons=[_arm_pair(c) for c in result.comparisons()],
        repeats=[(_arm_run(b), _arm_run(a)) for b, a in result.pairs()],
        stopped=(result.stopped, result.stop_words) if result.stopped else None,
    )


def report(
    store: Store, result: ExperimentResult, out: Path, stopping: Stopping | None = None
) -> ExperimentReports:
    """The experiment's reports (reports/experiment.py), each failure a red line."""
    plan = plan_of(stopping) if stopping is not None else None
    reports = build_reports(store, arms_of(result), out, plan)
    for failure in reports.failures:
        _error(failure)
    return reports


def conclude(
    store: Store, result: ExperimentResult, out: Path, stopping: Stopping | None
) -> tuple[ExperimentReports, list[OutcomeRow]]:
    """The reports written and the outcome shown: `experiment run`'s end, and `demo`'s."""
    reports = report(store, result, out, stopping)
    rows = outcome_rows(store, arms_of(result), reports)
    show_outcome(result, rows, reports)
    return reports, rows


def show_outcome(
    result: ExperimentResult, rows: list[OutcomeRow], reports: ExperimentReports
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


class LookJson(TypedDict):
    decided: bool
    words: list[str]


class OutcomeJson(TypedDict):
    """The experiment itself in `--json`, before its runs and reports."""

    experiment: str
    experiment_id: str
    status: str
    failure: str | None
    design: str
    order: str
    stopped: str
    stop_words: str
    sizing: str | None
    looks: list[LookJson]


def _outcome(result: ExperimentResult) -> OutcomeJson:
    return OutcomeJson(
        experiment=result.name,
        experiment_id=result.experiment_id,
        status=result.status,
        failure=result.failure,
        design=result.design,
        order=result.order,
        stopped=result.stopped,
        stop_words=result.stop_words,
        sizing=result.sizing,
        looks=[LookJson(decided=look.decided, words=look.words) for look in result.looks],
    )
