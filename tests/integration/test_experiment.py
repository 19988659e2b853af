"""The prefix-caching experiment end to end: two real vLLM servers (caching off and on) up at
once, each with its own collector sidecar, the same seeded Ralph-loop workload against each in
two interleaved repeats (A B B A), each run starting from an emptied prefix cache; runs stored
with levers and notes, lever flips, the pooled report and one per repeat."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from servescope.commands.experiment import ready_model
from servescope.reports.outcome import outcome_table
from tests.helpers.cli import servescope
from tests.helpers.experiments import whole


def _outcome_row(profile: str, repeat: int, hit: float | None) -> dict:
    return {
        "run_id": f"run-x-{profile}-r{repeat}", "profile": profile, "repeat": repeat,
        "status": "complete", "requests": 16, "errors": 0, "ttft_ms_p50": 301.2,
        "ttft_ms_p95": 812.4, "probe_ttft_ms_p50": 45.0, "tpot_ms_p50": 3.04,
        "server_prefix_cache_hit_ratio": hit, "client_cached_token_ratio": 0.957,
        "preemptions": 0, "spec_decode_acceptance_rate": None, "server_ready_s": 80.1,
        "speculative": True, "ttft_source": "client",
    }  # fmt: skip


def _rendered(rows: list[dict], width: int) -> str:
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=False)  # a pipe: no terminal
    console.print(outcome_table(rows, console))
    return out.getvalue()


@pytest.mark.parametrize("repeats", [1, 3])
def test_the_outcome_table_is_readable_at_80_columns(repeats: int) -> None:
    """Printed to a pipe (80 columns), every heading, run and figure shows whole; a terminal
    wide enough keeps one line per run."""
    profiles = ["max-num-seqs-2", "max-num-seqs-8", "max-num-seqs-32"]
    rows = [_outcome_row(p, r, 0.25) for r in range(1, repeats + 1) for p in profiles]
    text = _rendered(rows, 80)
    whole(text)
    labels = profiles if repeats == 1 else [f"{p} r{r}" for p in profiles for r in (1, 2, 3)]
    for label in labels:
        assert label in text
    assert text.count("25.0%") == len(rows) and text.count("95.7%") == len(rows)
    wide = _rendered(rows, 200)
    assert [line.count("max-num-seqs") for line in wide.splitlines()].count(1) == len(rows)


def test_a_model_folder_the_user_names_is_never_rebuilt(tmp_path: Path) -> None:
    """`experiment run --model DIR` with a dummy-weights config (as a GPU server serves the 8B
    shape with `--load-format dummy`) once had the tiny model written over it."""
    config = Path(__file__).resolve().parents[1] / "fixtures" / "gpu" / "kv" / "config-8b.json"
    model = tmp_path / "llama-8b-dummy"
    model.mkdir()
    (model / "config.json").write_bytes(config.read_bytes())
    assert ready_model(model, "random", given=True)
    assert [p.name for p in model.iterdir()] == ["config.json"]
    assert (model / "config.json").read_bytes() == config.read_bytes()
    assert not ready_model(tmp_path / "typo", "random", given=True)
    result = servescope(
        "experiment", "run", "prefix-caching", "--model", str(tmp_path / "typo"),
        "--store", str(tmp_path / "s.duckdb"),
    )  # fmt: skip
    assert result.returncode == 2 and "no model folder" in result.stdout + result.stderr
    assert not (tmp_path / "typo").exists()
