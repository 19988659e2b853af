"""The end-to-end tier: every test here starts a real vLLM (or shares the session's), so every
test here carries the `vllm` marker, set once for the folder rather than file by file: a test
added here is deselected by `-m "not vllm"` without anyone having to remember the marker."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the marker must be there when it reads
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.vllm)
