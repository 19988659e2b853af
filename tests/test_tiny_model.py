"""The tiny model is built locally and deterministically."""

from pathlib import Path

from bench.tiny_model import checksum
from tests.conftest import servescope


def test_two_builds_are_byte_identical(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    out_a = servescope("model", "make-tiny", str(first), check=True).stdout
    out_b = servescope("model", "make-tiny", str(second), check=True).stdout
    assert checksum(first) == checksum(second)
    assert out_a.split("sha256:")[1] == out_b.split("sha256:")[1]
    files = sorted(p.name for p in first.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(
        files
    )


def test_make_tiny_is_idempotent(tmp_path: Path) -> None:
    target = tmp_path / "m"
    servescope("model", "make-tiny", str(target), check=True)
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    again = servescope("model", "make-tiny", str(target), check=True)
    assert "already" in again.stderr
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp
