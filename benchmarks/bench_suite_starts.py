"""Benchmark: the suite's chain of vLLM starts (issue #42): each start, what started it, how long
it took to answer, how long it lived, and what it bought (the tests it served).

The suite's length on two cores is mostly vLLM starting: every start costs 20-60 s of CPU before
a single test can use it. This runs the suite as `make test` does (`pytest -n 2 --dist loadgroup
--no-loadscope-reorder`; further arguments go to pytest) and, beside it, reads /proc every
0.25 s for vLLM API servers (`vllm serve …` or `-m vllm.entrypoints.openai.api_server`). Per
server:
- what started it: the `PYTEST_CURRENT_TEST` and `PYTEST_XDIST_WORKER` its environment inherited
  (a fixture's set-up, or a test that runs `servescope experiment run`/`demo` itself);
- its label: the folder of its log (the suite's fixtures name theirs: `vllm`, `vllm-spec`, …);
- its levers (the command line after the model);
- start (the process's own start time), ready (the first 200 from `/health` on its `--port`),
  end;
- what it bought: the tests its xdist worker ran while it was up (an upper bound: a worker may
  run tests that need no server beside it) and, for the session fixtures, how many tests name
  them (`pytest --fixtures-per-test`).

The reference is the suite's own wall time in the same run: printed are the starts' summed
seconds to ready and, per worker, the share of its wall time in which it waited for a vLLM to
answer (the chain), each against it.

Usage: .venv/bin/python benchmarks/bench_suite_starts.py [PYTEST ARGS …]
Last line: {"metric": "suite_vllm_starts", "starts": [...], "suite_s": …, ...} (JSON).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTEST = [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup",
          "--no-loadscope-reorder", "-p", "bench_suite_starts"]  # fmt: skip
SESSION_FIXTURES = ("vllm_server", "predictable_vllm_server", "spec_vllm_server")
TIMELINE_ENV = "SERVESCOPE_BENCH_TIMELINE"
POLL_S = 0.25


@dataclass
class Start:
    pid: int
    label: str
    started_by: str
    worker: str
    levers: str
    port: int
    start: float
    ready: float | None = None
    end: float | None = None
    tests: list[str] = field(default_factory=list)

    @property
    def ready_s(self) -> float | None:
        return None if self.ready is None else self.ready - self.start

    @property
    def lived_s(self) -> float | None:
        return None if self.end is None else self.end - self.start


def _is_api_server(cmdline: list[str]) -> bool:
    text = " ".join(cmdline)
    return "vllm.entrypoints.openai.api_server" in text or (
        len(cmdline) > 1 and cmdline[0].endswith("vllm") and cmdline[1] == "serve"
    )


def _label(proc: psutil.Process) -> str:
    """The folder of the server's log (its stdout), the suite's fixtures name them."""
    try:
        out = os.readlink(f"/proc/{proc.pid}/fd/1")
    except OSError:
        return "?"
    folder = Path(out).parent.name
    return re.sub(r"\d+$", "", folder) or folder


def _port(cmdline: list[str]) -> int:
    for i, arg in enumerate(cmdline[:-1]):
        if arg == "--port":
            return int(cmdline[i + 1])
    return 8000


def _levers(cmdline: list[str]) -> str:
    skip = {"--model", "--port", "--served-model-name", "--otlp-traces-endpoint",
            "--logging-config", "--host"}  # fmt: skip
    kept, i = [], 0
    rest = cmdline[cmdline.index("--model") + 2 :] if "--model" in cmdline else cmdline[2:]
    while i < len(rest):
        if rest[i] in skip:
            i += 2
            continue
        kept.append(rest[i])
        i += 1
    return " ".join(kept)


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False


class Sampler(threading.Thread):
    """Reads /proc for vLLM API servers until told to stop."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.root = (
            0  # the suite's pytest: servers outside its tree (another checkout's) are not its
        )
        self.starts: dict[int, Start] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.sample()
            self.done.wait(POLL_S)
        self.sample()

    def _ours(self, proc: psutil.Process) -> bool:
        try:
            return self.root in {p.pid for p in proc.parents()}
        except psutil.Error:
            return False

    def sample(self) -> None:
        now, seen = time.time(), set()
        for proc in psutil.process_iter(["pid", "cmdline", "create_time"]):
            cmdline = proc.info["cmdline"] or []
            if not _is_api_server(cmdline) or not self._ours(proc):
                continue
            seen.add(proc.pid)
            if proc.pid not in self.starts:
                try:
                    env = proc.environ()
                except psutil.Error:
                    env = {}
                self.starts[proc.pid] = Start(
                    pid=proc.pid,
                    label=_label(proc),
                    started_by=env.get("PYTEST_CURRENT_TEST", "?"),
                    worker=env.get("PYTEST_XDIST_WORKER", "?"),
                    levers=_levers(cmdline),
                    port=_port(cmdline),
                    start=proc.info["create_time"],
                )
        for start in self.starts.values():
            if start.end is None and start.pid not in seen:
                start.end = now
            elif start.end is None and start.ready is None and _healthy(start.port):
                start.ready = time.time()


# -- the pytest plugin (loaded with -p bench_suite_starts on the controller and the workers) --


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """On the controller: each test phase's worker and its start and stop (epoch seconds)."""
    path = os.environ.get(TIMELINE_ENV)
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    node = getattr(report, "node", None)
    worker = getattr(getattr(node, "gateway", None), "id", "?")
    line = {"test": report.nodeid, "when": report.when, "worker": worker,
            "start": report.start, "stop": report.stop}  # fmt: skip
    with open(path, "a") as fh:
        fh.write(json.dumps(line) + "\n")


def _fixture_users(args: list[str]) -> dict[str, int]:
    """How many tests name each session fixture (`pytest --fixtures-per-test`)."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--fixtures-per-test", "-q", *args],
        cwd=ROOT, capture_output=True, text=True, check=False,
    ).stdout  # fmt: skip
    users = dict.fromkeys(SESSION_FIXTURES, 0)
    for block in re.split(r"^-+ fixtures used by ", out, flags=re.M)[1:]:
        for name in SESSION_FIXTURES:
            if re.search(rf"^{name} -- ", block, re.M):
                users[name] += 1
    return users


def _waiting_share(starts: list[Start], worker: str, began: float, ended: float) -> float:
    """The share of a worker's wall time in which one of its vLLMs was starting."""
    spans = sorted((s.start, s.ready or s.end or ended) for s in starts if s.worker == worker)
    total, reach = 0.0, began
    for lo, hi in spans:
        lo = max(lo, reach)
        if hi > lo:
            total += hi - lo
            reach = hi
    return total / (ended - began) if ended > began else 0.0


def main() -> int:
    args = sys.argv[1:]
    timeline = Path(os.environ.get("TMPDIR", "/tmp")) / f"suite-timeline-{os.getpid()}.jsonl"
    env = {**os.environ, TIMELINE_ENV: str(timeline),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "benchmarks"),
                                                       os.environ.get("PYTHONPATH")]))}  # fmt: skip
    sampler = Sampler()
    began = time.time()
    suite = subprocess.Popen([*PYTEST, *args], cwd=ROOT, env=env)
    sampler.root = suite.pid
    sampler.start()
    code = suite.wait()
    ended = time.time()
    sampler.done.set()
    sampler.join()
    phases = [json.loads(x) for x in timeline.read_text().splitlines()] if timeline.exists() else []
    timeline.unlink(missing_ok=True)
    starts = sorted(sampler.starts.values(), key=lambda s: s.start)
    for s in starts:
        stop = s.end or ended
        s.tests = sorted({p["test"] for p in phases
                          if p["worker"] == s.worker and p["start"] < stop and p["stop"] > s.start
                          and p["when"] == "call"})  # fmt: skip
    users = _fixture_users(args)
    wall = ended - began
    summed = sum(s.ready_s or 0.0 for s in starts)
    workers = sorted({s.worker for s in starts})
    shares = {w: _waiting_share(starts, w, began, ended) for w in workers}

    print(f"suite: exit {code}, {wall:.0f} s wall; {len(starts)} vLLM starts")
    print(f"{'#':>2} {'worker':6} {'ready s':>7} {'lived s':>7} {'tests':>5}  label  levers  "
          "— started by")  # fmt: skip
    for i, s in enumerate(starts, 1):
        ready = f"{s.ready_s:7.1f}" if s.ready_s is not None else "      —"
        lived = f"{s.lived_s:7.0f}" if s.lived_s is not None else "      —"
        print(
            f"{i:>2} {s.worker:6} {ready} {lived} {len(s.tests):>5}  {s.label}  "
            f"{s.levers or '(defaults)'}  — {s.started_by}"
        )
    print("session fixtures, tests naming them: "
          + ", ".join(f"{k} {v}" for k, v in users.items()))  # fmt: skip
    print(f"tests timed: {sum(p['when'] == 'call' for p in phases)}")
    print(f"starts' summed seconds to ready: {summed:.0f} s = {summed / wall:.2f} of the wall time")
    for w, share in shares.items():
        print(f"worker {w}: waiting for a vLLM {share:.0%} of the wall time")
    result = {
        "metric": "suite_vllm_starts",
        "exit": code,
        "suite_s": round(wall, 1),
        "summed_ready_s": round(summed, 1),
        "ratio_summed_ready_to_suite": round(summed / wall, 3),
        "waiting_share": {w: round(v, 3) for w, v in shares.items()},
        "fixture_users": users,
        "starts": [
            {**asdict(s), "ready_s": s.ready_s, "lived_s": s.lived_s, "tests": len(s.tests)}
            for s in starts
        ],  # fmt: skip
    }
    print(json.dumps(result))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
