"""Workload files, plans and arrival schedules: no server needed, every rule checked on values."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.cli import servescope


def test_bad_input_exits_2_with_a_message(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("workloads:\n  - {name: w, input_tokens: 8, output_tokens: 8}\n")
    result = servescope("bench", "run", "--config", str(bad), "--store", str(tmp_path / "s"))
    assert result.returncode == 2 and "concurrency" in result.stderr
    result = servescope("bench", "run", "--config", "no-such-scenario")
    assert result.returncode == 2 and "ralph-loop" in result.stderr
    result = servescope("bench", "run", "--config", "rag", "--slo", "ttft=5")
    assert result.returncode == 2 and "unknown SLO metric" in result.stderr
    result = servescope("experiment", "run", "no-such-experiment")
    assert result.returncode == 2 and "prefix-caching" in result.stderr
