"""Profiles, levers and the command lines the launcher builds."""

import sys
from pathlib import Path

import pytest

from servescope.loadgen.launcher import (
    ALWAYS_FLAGS,
    extend_flags,
    levers_of,
    load_profiles,
    runnable,
    server_command,
)


def test_profiles_cover_the_seed_levers() -> None:
    profiles = load_profiles()
    assert {"default", "no-prefix-caching", "no-chunked-prefill"} <= set(profiles)
    default = levers_of(profiles["default"].flags)
    assert default["enable_prefix_caching"] is True
    assert default["enable_chunked_prefill"] is True
    for name, lever in (
        ("no-prefix-caching", "enable_prefix_caching"),
        ("no-chunked-prefill", "enable_chunked_prefill"),
    ):
        flags = profiles[name].flags
        assert f"--no-{lever.replace('_', '-')}" in flags
        assert f"--{lever.replace('_', '-')}" not in flags
        assert levers_of(flags) == {**default, lever: False}


def test_a_child_profiles_flag_replaces_its_parents_for_the_same_lever() -> None:
    base = ["--dtype", "float32", "--enable-prefix-caching", "--max-num-seqs=4"]
    assert extend_flags(base, ["--no-enable-prefix-caching", "--max-num-seqs", "8"]) == [
        "--dtype",
        "float32",
        "--no-enable-prefix-caching",
        "--max-num-seqs",
        "8",
    ]
    assert extend_flags(base, []) == base


def test_levers_are_named_like_vllm_args() -> None:
    flags = [
        "--max-num-seqs",
        "8",
        "--no-enable-prefix-caching",
        "--enable-log-requests",
        "--max-model-len=4096",
    ]
    assert levers_of(flags) == {
        "max_num_seqs": "8",
        "enable_prefix_caching": False,
        "enable_log_requests": True,
        "max_model_len": "4096",
    }


def test_vllm_cpu_is_started_as_the_api_server_module() -> None:
    command = server_command("/m", "tiny", 8123, load_profiles()["default"])
    assert command[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert command[command.index("--port") + 1] == "8123"
    assert command[command.index("--host") + 1] == "127.0.0.1"
    for flag in ALWAYS_FLAGS:
        assert flag in command


def test_vllm_serve_runs_as_the_module_where_no_vllm_script_is_on_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A GPU server with vLLM unpacked into a folder on PYTHONPATH has no `vllm` script: the
    GPU profiles' `vllm serve M …` runs as the API server module (the same server)."""
    gpu = server_command("/m", "m", 8000, load_profiles()["gpu-bench"])
    assert gpu[:3] == ["vllm", "serve", "/m"]  # what a user reads (serve --dry-run)
    monkeypatch.setenv("PATH", str(tmp_path))  # no vllm here
    assert runnable(gpu) == [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                             "--model", "/m", *gpu[3:]]  # fmt: skip
    script = tmp_path / "vllm"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    assert runnable(gpu) == gpu  # where the script is, it is used
    assert "--load-format" in gpu and "VLLM_CPU_KVCACHE_SPACE" not in load_profiles()[
        "gpu-bench"].env  # fmt: skip
