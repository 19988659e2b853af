"""Calibrate the before/after verdicts: how often an A/A comparison (nothing changed, runs
drifting as real runs do) gets a verdict, and how often a true effect is found, per design.

    .venv/bin/python benchmarks/bench_verdicts.py [--comparisons 60] [--effects 20] [--json]

Runs are synthetic (tests/helpers/calibration.py: two load levels of 60 requests, each run shifted
as a whole by TTFT ±10 %, TPOT ±5 %, pace ±8 %, 1 % failures), written to a real DuckDB store and
reported by `build_diff`, as `report build` does. Designs compared on the same runs:

* repeats: 3 (or 5) runs a side, as `report build A1 A2 A3 --vs B1 B2 B3` (the method);
* one run a side: the first run of each arm, request-level bootstrap, rows corrected;
* one run a side, uncorrected: the rule before repeats (a verdict wherever a row's 95 %
  interval excludes 0), the reference the method is measured against.

`--methods` compares candidate tests for one indicator (TTFT p50, 3 runs a side) on simulated
numbers alone, faster: what chose the method of reports/verdict.py (docs/verdicts.md).

`--sequential N` calibrates the stopping rule (reports/sequential.py): N A/A experiments that
look after every round from the third (at most `--max-repeats` a side), each then reported in
full at the look it stopped at (any row with a verdict counts), and N experiments each with a
true −25 % and −10 % TTFT (how often found, after how many repeats).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from rich.progress import Progress  # noqa: E402

from servescope.reports import ReportOptions, build_diff, verdict  # noqa: E402
from servescope.reports.sequential import MAX_REPEATS, Plan  # noqa: E402
from servescope.store import Store  # noqa: E402
from tests.helpers.calibration import Comparison, sequential_trial, store_comparison  # noqa: E402

CHANGED = ("improved", "regressed")
OPTIONS = ReportOptions(charts=False)


def _uncorrected(row: dict[str, Any]) -> bool:
    ci = row["ci95"]
    return ci is not None and row["verdict"] != "too few samples" and not ci[0] <= 0 <= ci[1]


def judge(store: Store, c: Comparison, design: str) -> dict[str, bool]:
    """Whether the comparison got a verdict on any row, and on the primary TTFT p50."""
    if design.startswith("one run"):
        after, before = c.after[:1], c.before[:1]
    else:
        after, before = c.after, c.before
    report = build_diff(store, after, before, OPTIONS)
    rows = report["diff"]
    primary = next(r for r in rows if r["role"] == "primary")
    if design == "one run, uncorrected":
        return {
            "any": any(_uncorrected(r) for r in rows),
            "primary": _uncorrected(primary),
            "found": _uncorrected(primary) and primary["delta"] < 0,
        }
    return {
        "any": any(r["verdict"] in CHANGED for r in rows),
        "primary": primary["verdict"] in CHANGED,
        "found": primary["verdict"] == "improved",
    }


def _medians_log(runs: list[np.ndarray]) -> np.ndarray:
    return np.log([np.median(r) for r in runs])


def _request_variance(rng: np.random.Generator, run: np.ndarray, draws: int = 300) -> float:
    picks = rng.integers(0, len(run), (draws, len(run)))
    return float(np.var(np.log(np.median(run[picks], axis=1))))


def _methods(rng: np.random.Generator, before: list[np.ndarray], after: list[np.ndarray]):
    """Which candidate tests call a change, on one comparison's runs."""
    b, a = _medians_log(before), _medians_log(after)
    vb = [_request_variance(rng, r) for r in before]
    va = [_request_variance(rng, r) for r in after]
    chosen = verdict.repeats_test(
        b, a, [np.sqrt(v) * np.array([-1.0, 1.0]) for v in vb],
        [np.sqrt(v) * np.array([-1.0, 1.0]) for v in va],
    )  # fmt: skip
    plain = verdict.repeats_test(b, a)
    assert chosen is not None and plain is not None

    def two_level(runs: list[np.ndarray]) -> np.ndarray:
        out = []
        for _ in range(300):
            picked = [runs[i] for i in rng.integers(0, len(runs), len(runs))]
            out.append(
                np.median(np.concatenate([r[rng.integers(0, len(r), len(r))] for r in picked]))
            )
        return np.log(out)

    delta = two_level(after) - two_level(before)
    lo, hi = np.percentile(delta, [2.5, 97.5])
    return {
        "two-level bootstrap (runs, then requests)": not lo <= 0 <= hi,
        "t on the runs' values": plain.p_value <= verdict.ALPHA,
        "t on the runs' values, request noise as floor (chosen)": chosen.p_value <= verdict.ALPHA,
    }


def compare_methods(trials: int, seed: int = 7) -> list[dict[str, Any]]:
    """Each candidate's rate of calls on A/A and on a −25 % TTFT, 3 runs a side, for request
    noise small and large against the run drift (±10 %) and runs of the same or new requests."""
    rng = np.random.default_rng(seed)
    results = []
    for n, sigma in ((48, 0.3), (48, 0.8), (1000, 0.5)):
        for effect in (1.0, 0.75):
            hits: dict[str, int] = {}
            for _ in range(trials):

                def run(factor: float, n: int = n, sigma: float = sigma) -> np.ndarray:
                    drift = rng.uniform(0.9, 1.1) * factor
                    return 200.0 * drift * rng.lognormal(0.0, sigma, n)

                called = _methods(
                    rng, [run(1.0) for _ in range(3)], [run(effect) for _ in range(3)]
                )
                for name, yes in called.items():
                    hits[name] = hits.get(name, 0) + yes
            for name, count in hits.items():
                results.append({"requests": n, "sigma": sigma, "effect": effect,
                                "method": name, "rate": count / trials})  # fmt: skip
    return results


def sequential(trials: int, plan: Plan) -> list[dict[str, Any]]:
    """The stopping rule's figures under `plan`: A/A experiments reported in full at their last
    look, and true effects of −25 % and −10 % on the primary's own path."""
    options = ReportOptions(charts=False, plan=plan)
    figures = []
    with tempfile.TemporaryDirectory() as folder, Progress(transient=True) as progress:
        store = Store(Path(folder) / "sequential.duckdb")
        task = progress.add_task("sequential experiments", total=3 * trials)
        for label, factor in (("A/A", 1.0), ("TTFT −25 %", 0.75), ("TTFT −10 %", 0.90)):
            seed0 = {1.0: 0, 0.75: 1000, 0.90: 2000}[factor]
            verdicts: dict[str, int] = {}
            looks, any_row = [], 0
            for i in range(trials):
                trial = sequential_trial(seed0 + i, factor, plan)
                verdicts[trial.verdict] = verdicts.get(trial.verdict, 0) + 1
                looks.append(trial.looks)
                if factor == 1.0:
                    c = store_comparison(store, f"s{i}", seed0 + i, trial.looks)
                    report = build_diff(store, c.after, c.before, options)
                    any_row += any(r["verdict"] in CHANGED for r in report["diff"])
                progress.advance(task)
            figures.append(
                {
                    "comparisons": label,
                    "n": trials,
                    "verdicts": {k: v / trials for k, v in sorted(verdicts.items())},
                    "any_row_verdict": any_row / trials if factor == 1.0 else None,
                    "mean_repeats": float(np.mean(looks)),
                    "most_repeats": max(looks),
                }
            )
    return figures


def print_sequential(trials: int, max_repeats: int, as_json: bool) -> int:
    """`--sequential`: the stopping rule's calibration, one line per kind of experiment."""
    rows = sequential(trials, Plan(last=max_repeats))
    if as_json:
        print(json.dumps(rows))
        return 0
    for r in rows:
        shares = ", ".join(f"{k} {v:.1%}" for k, v in r["verdicts"].items())
        seen = r["any_row_verdict"]
        anyrow = f"; any row {seen:.1%}" if seen is not None else ""
        print(f"{r['comparisons']:<11} n={r['n']}: {shares}{anyrow}; "
              f"mean {r['mean_repeats']:.1f} repeats a side")  # fmt: skip
    return 0


def print_methods(trials: int, as_json: bool) -> int:
    """`--methods`: the candidate tests' rates of verdicts, one line per method and case."""
    rows = compare_methods(trials)
    if as_json:
        print(json.dumps(rows))
        return 0
    for r in rows:
        kind = "A/A" if r["effect"] == 1.0 else "−25 %"
        print(f"n={r['requests']:<5} σ={r['sigma']:<4} {kind:<6} {r['rate']:>5.1%}  {r['method']}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--comparisons", type=int, default=60, help="A/A comparisons")
    parser.add_argument("--effects", type=int, default=20, help="comparisons per true effect")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument(
        "--methods",
        type=int,
        metavar="TRIALS",
        help="compare candidate tests on TRIALS simulations",
    )
    parser.add_argument(
        "--sequential",
        type=int,
        metavar="TRIALS",
        help="calibrate the stopping rule on TRIALS experiments of each kind",
    )
    parser.add_argument(
        "--max-repeats",
        type=int,
        default=MAX_REPEATS,
        help=f"the plan's last look (default {MAX_REPEATS}, the experiments' default)",
    )
    args = parser.parse_args()
    if args.sequential:
        return print_sequential(args.sequential, args.max_repeats, args.json)
    if args.methods:
        return print_methods(args.methods, args.json)
    started = time.perf_counter()
    designs = ["3 repeats a side", "5 repeats a side", "one run, corrected",
               "one run, uncorrected"]  # fmt: skip
    effects = {"A/A": 1.0, "TTFT −25 %": 0.75, "TTFT −10 %": 0.90}
    counts = {
        (d, e): dict.fromkeys(("any", "primary", "found", "n"), 0) for d in designs for e in effects
    }
    with tempfile.TemporaryDirectory() as folder, Progress(transient=True) as progress:
        store = Store(Path(folder) / "calibration.duckdb")
        total = sum(args.comparisons if e == "A/A" else args.effects for e in effects)
        task = progress.add_task("comparisons", total=total)
        for e_index, (effect, factor) in enumerate(effects.items()):
            n = args.comparisons if effect == "A/A" else args.effects
            for i in range(n):
                seed = 10_000 * (e_index + 1) + i
                three = store_comparison(store, f"c{seed}", seed, 3, factor)
                five = store_comparison(store, f"f{seed}", seed + 5_000, 5, factor)
                for design in designs:
                    comparison = five if design.startswith("5") else three
                    got = judge(store, comparison, design)
                    tally = counts[(design, effect)]
                    tally["n"] += 1
                    for key in ("any", "primary", "found"):
                        tally[key] += got[key]
                progress.advance(task)
    figures = [
        {
            "design": d,
            "comparisons": effect,
            "n": t["n"],
            "any_row_verdict": t["any"] / t["n"],
            "primary_verdict": t["primary"] / t["n"],
            "found_improved": t["found"] / t["n"],
        }
        for (d, effect), t in counts.items()
    ]
    if args.json:
        print(json.dumps({"figures": figures, "seconds": time.perf_counter() - started}))
        return 0
    print("design                 | comparisons | n   | any row verdict | primary verdict | found")
    for f in figures:
        print(
            f"{f['design']:<22} | {f['comparisons']:<11} | {f['n']:<3} | "
            f"{f['any_row_verdict']:>15.0%} | {f['primary_verdict']:>15.0%} | "
            f"{f['found_improved']:>5.0%}"
        )
    print(f"({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
