"""Ports for the servers servescope starts (store/settings.py `free_port`), and the experiment's
collector sidecar (loadgen/sidecar.py) as real `servescope collect` processes: it starts, tells
vLLM where to send traces, and stops cleanly; a port taken by another process between the look
and the bind (a race a busy machine makes real) costs a second start on another port, not the
experiment."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from servescope.loadgen import sidecar
from servescope.store import Store, settings
from servescope.store.settings import free_port


def _port_of(flags: list[str]) -> int:
    return int(flags[flags.index("--otlp-traces-endpoint") + 1].rsplit(":", 1)[1].split("/")[0])


def test_a_port_taken_before_the_bind_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as taken:
        taken.bind((settings.HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = iter([port])  # the first look finds a port another process binds next
        monkeypatch.setattr(settings, "free_port", lambda: next(ports, None) or free_port())
        collector = sidecar.CollectorSidecar(
            Store(tmp_path / "s.duckdb"), tmp_path / "logs" / "vllm.log", "http://127.0.0.1:9"
        )
        try:
            got = _port_of(collector.flags)
            assert got != port and settings.listening(got)
            log = collector.output.read_text()
            assert "Address already in use" in log and f"traces on http://127.0.0.1:{got}" in log
        finally:
            collector.close()
    assert collector.process.returncode == 0


def test_free_ports_come_from_below_theephemeral_range() -> None:
    """A port from the ephemeral range is where outgoing connections take their local ports: one
    could take it before the server binds. free_port draws below it."""
    low, _ = settings.ephemeral_range()
    ports = {free_port() for _ in range(50)}
    assert all(settings.FREE_PORTS_FROM <= p < low for p in ports) and len(ports) > 40
    for port in ports:
        with socket.socket() as sock:
            sock.bind((settings.HOST, port))  # free: nothing bound it since
