"""`servescope capacity` as a user types it on a GPU question: `--gpu NAME` uses the card's
total as CUDA reports it and says where that figure comes from, `--gpu-memory-gib`'s help says
which total it wants, a value that looks like nvidia-smi's total or a marketing size is computed
as given with a warning on stderr (exit 0), an unknown card is exit 2 with the known ones, and
data parallelism gives per-engine numbers with the totals beside them."""

from __future__ import annotations

import json
from pathlib import Path

from servescope.loadgen import gpu_memory
from tests.helpers.cli import servescope

CONFIG = Path(__file__).resolve().parents[1] / "fixtures" / "gpu" / "kv" / "config-8b.json"


def test_gpu_name_gives_cuda_s_total_and_its_source() -> None:
    result = servescope("capacity", str(CONFIG), "--gpu", "H100", "--json", check=True)
    out = json.loads(result.stdout)
    assert out["gpu_memory"]["total"] == gpu_memory.card("H100-80GB").cuda_gib  # type: ignore[union-attr]
    assert "81,559 MiB less 480 reserved" in out["settings"]["gpu_memory_source"]
    assert result.stderr.strip() == ""
    text = servescope("capacity", str(CONFIG), "--gpu", "H100", check=True).stdout
    assert "| GPU memory (as CUDA reports it) | 79.18 GiB: H100-80GB: recorded here" in text


def test_the_help_says_which_total() -> None:
    help_text = " ".join(servescope("capacity", "--help", check=True).stdout.split())
    assert "nvidia-smi's total less its reserved memory" in help_text
    assert "79.18 on an H100 80GB, not nvidia-smi's 81,559 MiB nor 80" in help_text


def test_a_total_that_looks_like_nvidia_smi_s_is_a_warning_not_an_error() -> None:
    result = servescope("capacity", str(CONFIG), "--gpu-memory-gib", "79.65", "--json")
    assert result.returncode == 0
    warning = " ".join(result.stderr.split())
    assert warning.startswith("warning: --gpu-memory-gib 79.65 GiB looks like nvidia-smi's total")
    assert "--gpu H100-80GB" in warning
    assert json.loads(result.stdout)["gpu_memory"]["total"] == 79.65  # computed as given


def test_an_unknown_card_is_bad_input() -> None:
    result = servescope("capacity", str(CONFIG), "--gpu", "X9000")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "unknown card 'X9000'" in " ".join(result.stderr.split())


def test_data_parallel_engines_each_size_their_own_cache() -> None:
    one = json.loads(servescope("capacity", str(CONFIG), "--gpu", "H200", "--json",
                                check=True).stdout)  # fmt: skip
    two = json.loads(servescope("capacity", str(CONFIG), "--gpu", "H200", "--json",
                                "--data-parallel-size", "2", check=True).stdout)  # fmt: skip
    assert two["kv_tokens"] == one["kv_tokens"] and two["gpus"] == 2
    assert two["kv_tokens_all_engines"] == 2 * one["kv_tokens"]
