"""Server profiles for real deployments: the command lines they give (GPU ones cannot run here)."""

from __future__ import annotations

import shlex

from servescope.loadgen.launcher import load_profiles, server_set
from tests.helpers.cli import servescope

MODEL = "deepseek-ai/DeepSeek-Coder-V2-Lite-Instruct"


def _lines(*args: str) -> list[list[str]]:
    out = servescope("serve", "--dry-run", "--model", MODEL, *args, check=True).stdout
    return [shlex.split(line) for line in out.splitlines() if line.strip()]


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_single_gpu_is_the_seeds_vllm_serve_line() -> None:
    (argv,) = _lines("--profile", "gpu-single", "--port", "8000")
    env = [a for a in argv if "=" in a and not a.startswith("--")]
    command = argv[len(env) :]
    assert command[:3] == ["vllm", "serve", MODEL]
    assert _flag(command, "--max-model-len") == "32768"
    assert _flag(command, "--gpu-memory-utilization") == "0.90"
    assert "--enable-prefix-caching" in command
    assert _flag(command, "--port") == "8000"
    assert not any(e.startswith("HF_HUB_OFFLINE") for e in env)  # a real model comes from the hub
    assert "--tensor-parallel-size" not in command


def test_multi_gpu_adds_tensor_parallelism() -> None:
    (argv,) = _lines("--profile", "gpu-multi")
    assert _flag(argv, "--tensor-parallel-size") == "2"
    assert "NCCL_NVLS_ENABLE=0" in argv[: argv.index("vllm")]
    assert _flag(argv, "--gpu-memory-utilization") == "0.90"


def test_mig_gives_one_pinned_server_per_slice() -> None:
    lines = _lines("--profile", "mig-isolated", "--mig", "MIG-aaaa-1111", "--mig", "MIG-bbbb-2222")
    assert len(lines) == 2
    (a, b) = lines
    assert "CUDA_VISIBLE_DEVICES=MIG-aaaa-1111" in a and "CUDA_VISIBLE_DEVICES=MIG-bbbb-2222" in b
    assert (_flag(a, "--port"), _flag(b, "--port")) == ("8001", "8002")
    assert (_flag(a, "--served-model-name"), _flag(b, "--served-model-name")) == (
        "team-a-coder",
        "team-b-coder",
    )
    assert (_flag(a, "--max-model-len"), _flag(b, "--max-model-len")) == ("16384", "32768")


def test_gpu_profiles_refuse_to_start_without_a_gpu() -> None:
    result = servescope("serve", "--profile", "gpu-single", "--model", MODEL)
    assert result.returncode == 2 and "needs a GPU" in result.stderr
    result = servescope(
        "serve", "--profile", "mig-isolated", "--mig", "a", "--mig", "b", "--mig", "c"
    )
    assert result.returncode == 2


def test_cpu_profiles_stay_offline_and_levers_follow_flags() -> None:
    profiles = load_profiles()
    (server,) = server_set("/models/tiny", profiles["max-num-seqs-8"], port=9001)
    assert server.levers["max_num_seqs"] == "8"
    assert "HF_HUB_OFFLINE=1" in server.describe()
    assert all(p.device == "cpu" for n, p in profiles.items() if not n.startswith(("gpu", "mig")))
