"""How long a `servescope` command takes to start, against the same process importing every
command's rooms (what each call paid before the CLI imported only the command typed), measured in
the same run, alternating: wall seconds of `servescope store runs` on an empty store, and of
`python -c "import servescope.commands.X" …` for every command module.

    .venv/bin/python benchmarks/bench_cli_startup.py --rounds 5

The last line is JSON: {"metric": "cli_startup_s", "ours": X, "reference": Y, "ratio": X/Y}
(medians of the rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from servescope.commands import NAMES


def timed(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, capture_output=True, check=False)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "s.duckdb"
        ours_cmd = [sys.executable, "-m", "servescope.cli", "store", "runs", "--store", str(store)]
        every = "; ".join(f"import servescope.commands.{name}" for name in NAMES)
        reference_cmd = [sys.executable, "-c", f"{every}; import servescope.cli"]
        timed(ours_cmd), timed(reference_cmd)  # warm the file cache
        ours, reference = [], []
        for i in range(args.rounds):
            ours.append(timed(ours_cmd))
            reference.append(timed(reference_cmd))
            print(
                f"round {i + 1}: ours {ours[-1]:.3f} s, every room imported {reference[-1]:.3f} s"
            )
    o, r = statistics.median(ours), statistics.median(reference)
    print(json.dumps({"metric": "cli_startup_s", "ours": round(o, 3), "reference": round(r, 3),
                      "ratio": round(o / r, 3)}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
