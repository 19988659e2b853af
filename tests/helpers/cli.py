"""The CLI as a user runs it, and where the checkout keeps what the tests read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from servescope.store import settings

ROOT = Path(__file__).resolve().parents[2]
# The tiny models, where the Makefile builds them: an input of the suite, never its output.
MODELS = ROOT / settings.DEFAULT_DATA_DIR / "models"
SERVESCOPE = [sys.executable, "-m", "servescope.cli"]


def bench_args(config: str | Path, target: str, run_id: str, store: str | Path) -> list[str]:
    """`servescope bench run` arguments: one workload file against one server, into one store."""
    return ["bench", "run", "--config", str(config), "--target", target, "--run-id", run_id,
            "--store", str(store)]  # fmt: skip


def servescope(
    *args: str,
    cwd: Path | None = None,
    timeout: float = 900,
    check: bool = False,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run the CLI as a user would; returns the completed process (stdout/stderr as text)."""
    result = subprocess.run(
        [*SERVESCOPE, *args],
        cwd=cwd or ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    if check and result.returncode != 0:
        raise AssertionError(f"servescope {' '.join(args)} -> {result.returncode}\n{result.stderr}")
    return result


def read_events(path: Path) -> list[dict]:
    """An `.events.jsonl` file's records."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def capacity(config: dict[str, Any] | Path, tmp_path: Path, *args: str) -> dict[str, Any]:
    if isinstance(config, dict):
        path = tmp_path / "config.json"
        path.write_text(json.dumps(config))
    else:
        path = config
    result = servescope("capacity", str(path), *args, "--json", check=True)
    return json.loads(result.stdout)
