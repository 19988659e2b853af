"""The integration tier's fixtures that several of its modules use."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from servescope.loadgen import experiment as loadgen_experiment
from tests.helpers.experiments import FakeServer, ResetServer

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-port=0",
    "--window-size=1280,1600",
]


@pytest.fixture
def fake_servers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[FakeServer]]:
    FakeServer.made, FakeServer.calls = [], []
    monkeypatch.setattr(loadgen_experiment, "VllmServer", FakeServer)
    yield FakeServer.made
    for server in FakeServer.made:
        server.http.close()


@pytest.fixture
def chromium() -> Iterator[str]:
    """A headless Chromium of our own; yields its DevTools HTTP endpoint."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    assert binary, "Chromium is not installed (Debian package `chromium`; see the Makefile)"
    profile = Path(tempfile.mkdtemp(prefix="servescope-chromium-"))
    process = subprocess.Popen(
        [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            assert process.poll() is None, f"Chromium exited with {process.returncode}"
            assert time.monotonic() < deadline, "Chromium did not open its DevTools port"
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port_file.read_text().split()[0]}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def reset_servers() -> Iterator[list[ResetServer]]:
    """Servers answering vLLM's reset (and sleep) endpoints that a test makes; closed after it."""
    made: list[ResetServer] = []
    yield made
    for server in made:
        server.close()
