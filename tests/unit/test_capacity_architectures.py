"""The capacity worksheet beyond dense Llama shapes: mixture-of-experts weights (routed, shared,
dense layers, expert parallelism), MLA's KV latent, vLLM's hybrid KV groups for sliding-window
layers, weights read from safetensors headers (packed tensors as stored), and the refusals:
an architecture the worksheet does not model is a clear error, never a number."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from servescope.loadgen import architecture
from servescope.loadgen.capacity import (
    GIB,
    CapacityError,
    Settings,
    compute,
    from_levers,
    load_shape,
)

SHAPES = Path(__file__).parents[2] / "benchmarks" / "gpu" / "shapes"


def _config(tmp_path: Path, shape: str, **changes: object) -> Path:
    """A shape's config.json with some keys changed (the published vocabulary, say)."""
    config = {**json.loads((SHAPES / f"{shape}.json").read_text()), **changes}
    folder = tmp_path / shape
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    "shape, vocab, published",
    [("deepseek-v2-lite", 102_400, 15.7e9), ("qwen1.5-moe-a2.7b", 151_936, 14.3e9),
     ("qwen3-30b-a3b", 151_936, 30.5e9), ("gemma-2-9b", 256_000, 9.24e9)],
)  # fmt: skip
def test_parameters_from_the_config_are_the_published_ones(
    tmp_path: Path, shape: str, vocab: int, published: float
) -> None:
    """With the published vocabulary, the architecture-aware count is the model card's."""
    found = load_shape(_config(tmp_path, shape, vocab_size=vocab))
    assert found.parameters == pytest.approx(published, rel=0.005)
    assert found.parameters_basis.startswith("config.json (architecture-aware estimate")


def test_deepseek_v2_lite_by_hand(tmp_path: Path) -> None:
    """27 layers: MLA (q 2048×16×192, kv_a 2048×576, its norm, kv_b 512×16×256, o 2048×2048),
    layer 0 a dense MLP of 10,944, layers 1-26 a router of 64, 64 experts of 1,408 and two shared
    ones (2,816 wide); untied embeddings. KV: one latent of 512 + 64 values a layer."""
    shape = load_shape(_config(tmp_path, "deepseek-v2-lite", vocab_size=102_400))
    attention = 2048 * 16 * 192 + 2048 * 576 + 512 + 512 * 16 * 256 + 16 * 128 * 2048
    moe = 64 * 2048 + 64 * 3 * 2048 * 1408 + 3 * 2048 * 2816
    params = 27 * (attention + 2 * 2048) + 3 * 2048 * 10944 + 26 * moe + 2 * 102_400 * 2048 + 2048
    assert shape.parameters == params
    out = compute(shape, Settings(kv_cache_gib=10, max_model_len=8192, device="cuda"))
    assert out["kv_bytes_per_token"] == 27 * 576 * 2 == 31_104  # not 2 × 16 × 128 × 2 × 27
    tp2 = compute(shape, Settings(kv_cache_gib=10, max_model_len=8192, tensor_parallel_size=2,
                                  device="cuda"))  # fmt: skip
    assert tp2["kv_bytes_per_token"] == 31_104  # the latent is whole on every GPU
    assert out["architecture"]["attention"] == "MLA"
    assert list(out["architecture"]["moe"]["dense_layers"]) == [0]


def test_expert_parallelism_spreads_the_experts_whole() -> None:
    """TP = 2 splits every expert's width; with --enable-expert-parallel each GPU holds half the
    experts whole, and with DP = 2 the attention is whole on each GPU too."""
    shape = load_shape(SHAPES / "qwen1.5-moe-a2.7b.json")

    def per_gpu(**flags: object) -> int:
        settings = Settings(kv_cache_gib=10, max_model_len=8192, device="cuda", **flags)  # type: ignore[arg-type]
        return int(compute(shape, settings)["model"]["weight_bytes_per_gpu"])

    one, tp2 = per_gpu(), per_gpu(tensor_parallel_size=2)
    tp2_ep = per_gpu(tensor_parallel_size=2, enable_expert_parallel=True)
    dp2_ep = per_gpu(data_parallel_size=2, enable_expert_parallel=True)
    experts = 60 * 3 * 2048 * 1408 * 2 * 24
    assert tp2 == pytest.approx(one / 2, rel=0.01) and tp2_ep == pytest.approx(tp2, rel=0.01)
    assert dp2_ep == pytest.approx(one - experts / 2, rel=0.01)
    assert per_gpu(data_parallel_size=2) == one  # without EP each engine holds every expert


def test_gemma2_s_sliding_layers_form_vllm_s_two_groups() -> None:
    """21 sliding (4,096) and 21 full layers: two groups of 21 sharing one pool; blocks =
    space / (page × 21); a request at max_model_len holds the full group's blocks and the
    sliding group's min(window − 1 + batched tokens, max_model_len) blocks plus one."""
    shape = load_shape(SHAPES / "gemma-2-9b.json")
    settings = Settings(kv_cache_gib=50, max_model_len=8192, device="cuda",
                        max_num_batched_tokens=2048)  # fmt: skip
    out = compute(shape, settings)
    page = 16 * 2 * 8 * 256 * 2
    blocks = 50 * GIB // (page * 21)
    need = 8192 // 16 + math.ceil((4096 - 1 + 2048) / 16) + 1
    assert out["kv_blocks"] == blocks and out["max_concurrency"] == round(blocks / need, 4)
    assert out["kv_tokens"] == int(blocks / need * 8192)
    assert out["architecture"]["kv_cache_groups"] == 2
    assert out["architecture"]["layers_sliding"] == 21


def test_a_model_whose_every_layer_slides() -> None:
    """Mistral-7B's window of 4,096 in all 32 layers: one group; at max_model_len 32,768 a
    request holds only its window's blocks, so the concurrency is larger than the pool's
    tokens over max_model_len."""
    shape = load_shape(SHAPES / "mistral-7b.json")
    settings = Settings(kv_cache_gib=20, max_model_len=32768, device="cuda",
                        max_num_batched_tokens=8192)  # fmt: skip
    out = compute(shape, settings)
    blocks = 20 * GIB // (16 * 2 * 8 * 128 * 2 * 32)
    need = math.ceil((4096 - 1 + 8192) / 16) + 1
    assert out["max_concurrency"] == round(blocks / need, 4)
    assert out["max_concurrency"] > blocks * 16 / 32768


def test_qwen_s_turned_off_window_is_full_attention() -> None:
    """Qwen2-MoE's config has sliding_window 32,768 with use_sliding_window false."""
    shape = load_shape(SHAPES / "qwen1.5-moe-a2.7b.json")
    assert set(shape.arch().layer_kinds) == {"full"}


@pytest.mark.parametrize(
    "changes, words",
    [({"model_type": "made_up_moe", "architectures": ["MadeUpForCausalLM"]}, "not one the"),
     ({"model_type": "jamba"}, "per-sequence state"),
     ({"model_type": "qwen3_next"}, "per-sequence state"),
     ({"layer_types": ["linear_attention"] * 24}, "linear_attention")],
)  # fmt: skip
def test_an_unmodelled_architecture_is_refused(
    tmp_path: Path, changes: dict[str, object], words: str
) -> None:
    with pytest.raises(CapacityError, match=words):
        load_shape(_config(tmp_path, "qwen1.5-moe-a2.7b", **changes))


def test_no_kv_cache_comes_with_its_reason() -> None:
    """DeepSeek-V2-Lite's 28.5 GiB of weights on a 24 GiB card: 0 tokens, and why."""
    out = compute(load_shape(SHAPES / "deepseek-v2-lite.json"),
                  Settings(gpu_memory_gib=22.03, gpu_name="L4", max_model_len=8192))  # fmt: skip
    assert out["kv_tokens"] == 0
    assert "exceed GPU memory × utilization" in out["kv_tokens_reason"]
    assert out["kv_tokens_reason"] in out["warnings"]


def _safetensors(path: Path, tensors: dict[str, tuple[str, list[int], int]]) -> None:
    """A safetensors file: name → (dtype, shape, bytes), zeros for data."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape, size) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def test_weights_from_the_headers_packed_tensors_as_stored(tmp_path: Path) -> None:
    """A GPTQ-style checkpoint: int4 weights packed in int32 words and fp16 scales are served as
    stored; float tensors (bf16, fp16) at --dtype; expert tensors spread by expert parallelism."""
    folder = _config(tmp_path, "qwen1.5-moe-a2.7b")
    _safetensors(folder / "model-00001-of-00002.safetensors", {
        "model.embed_tokens.weight": ("BF16", [749, 2048], 749 * 2048 * 2),
        "model.layers.0.self_attn.qkv.qweight": ("I32", [256, 6144], 256 * 6144 * 4),
        "model.layers.0.self_attn.qkv.scales": ("F16", [16, 6144], 16 * 6144 * 2),
    })  # fmt: skip
    _safetensors(folder / "model-00002-of-00002.safetensors", {
        "model.layers.0.mlp.experts.0.up_proj.qweight": ("I32", [256, 1408], 256 * 1408 * 4),
    })  # fmt: skip
    shape = load_shape(folder)
    assert shape.parameters_basis.startswith("weights (safetensors headers of 2 file(s)")
    out = compute(shape, Settings(kv_cache_gib=1, max_model_len=8192))
    rest = 749 * 2048 * 2 + 256 * 6144 * 4 + 16 * 6144 * 2
    assert out["model"]["weight_bytes"] == rest + 256 * 1408 * 4
    fp32 = compute(shape, Settings(kv_cache_gib=1, max_model_len=8192, dtype="float32"))
    floats = 749 * 2048 * 2 + 16 * 6144 * 2  # bf16 and fp16 tensors, served at float32
    assert fp32["model"]["weight_bytes"] == rest + floats + 256 * 1408 * 4
    ep = compute(shape, Settings(kv_cache_gib=1, max_model_len=8192, tensor_parallel_size=2,
                                 enable_expert_parallel=True))  # fmt: skip
    rounding = architecture.rounding_bytes(shape.arch(), shape.dims(),
                                           architecture.Parallel(2, 1, True), 2)  # fmt: skip
    assert ep["model"]["weight_bytes_per_gpu"] == rest // 2 + 256 * 1408 * 4 // 2 + rounding


def test_an_index_without_its_shards_gives_the_stored_total(tmp_path: Path) -> None:
    folder = _config(tmp_path, "deepseek-v2-lite")
    index = {"metadata": {"total_size": 31_412_968_448}, "weight_map": {}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    shape = load_shape(folder)
    assert "total_size" in shape.parameters_basis
    out = compute(shape, Settings(kv_cache_gib=1, max_model_len=8192))
    assert out["model"]["weight_bytes"] == 31_412_968_448
    assert shape.parameters == architecture.parameters(shape.arch(), shape.dims())


def test_a_launched_server_s_unmodelled_model_is_said(tmp_path: Path) -> None:
    """The launcher records servescope's numbers next to vLLM's statement: for a model the
    worksheet does not model, why, not a blank."""
    folder = _config(tmp_path, "qwen1.5-moe-a2.7b", model_type="jamba")
    note = from_levers(folder, {"max_model_len": "8192"}, {"VLLM_CPU_KVCACHE_SPACE": "4"})
    assert note is not None and note["kv_tokens"] is None
    assert "per-sequence state" in str(note["not_modelled"])
    ep = from_levers(SHAPES / "qwen1.5-moe-a2.7b.json",
                     {"max_model_len": "8192", "enable_expert_parallel": True},
                     {"VLLM_CPU_KVCACHE_SPACE": "4"})  # fmt: skip
    assert ep is not None and ep["kv_tokens"]


@pytest.mark.parametrize(
    "keys, dense",
    [({"model_type": "qwen2_moe", "num_experts": 8, "decoder_sparse_step": 2}, [0, 2]),
     ({"model_type": "qwen3_moe", "num_experts": 8, "mlp_only_layers": [1]}, [1]),
     ({"model_type": "deepseek_v3", "n_routed_experts": 8, "first_k_dense_replace": 1,
       "moe_layer_freq": 2}, [0, 1, 3]),
     ({"model_type": "mixtral", "num_local_experts": 8}, [])],
)  # fmt: skip
def test_which_layers_hold_experts(keys: dict[str, object], dense: list[int]) -> None:
    """vLLM's rules: Qwen's layer i has experts when (i + 1) % decoder_sparse_step == 0 and i
    is not in mlp_only_layers; DeepSeek's from first_k_dense_replace on, when i % moe_layer_freq
    == 0."""
    arch = architecture.parse({"intermediate_size": 64, **keys}, 4)
    assert arch.moe is not None and list(arch.moe.dense_layers) == dense


def test_gemma3_s_five_local_layers_to_one_global(tmp_path: Path) -> None:
    """Gemma-3-12B (a multimodal config; its text_config): 40 sliding (1,024) and 8 full layers
    make six groups of 8; a request at 8,192 holds 512 blocks in the full group and
    ceil(min(1,023 + 2,048, 8,192) / 16) + 1 = 193 in each sliding one. The vision tower is
    named as not counted."""
    text = {"model_type": "gemma3_text", "hidden_size": 3840, "num_hidden_layers": 48,
            "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
            "intermediate_size": 15360, "sliding_window": 1024, "sliding_window_pattern": 6,
            "vocab_size": 262208, "max_position_embeddings": 131072}  # fmt: skip
    config = {"model_type": "gemma3", "text_config": text, "vision_config": {"hidden_size": 1152}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = load_shape(tmp_path)
    out = compute(shape, Settings(kv_cache_gib=20, max_model_len=8192, device="cuda",
                                  max_num_batched_tokens=2048))  # fmt: skip
    assert (
        out["architecture"]["layers_sliding"] == 40 and out["architecture"]["kv_cache_groups"] == 6
    )
    blocks = 20 * GIB // (16 * 2 * 8 * 256 * 2 * 8)
    assert out["max_concurrency"] == round(blocks / (512 + 5 * 193), 4)
    assert any("vision encoder" in w for w in out["warnings"])


@pytest.mark.parametrize(
    "config, published",
    [({"model_type": "olmoe", "hidden_size": 2048, "num_hidden_layers": 16,
       "num_attention_heads": 16, "intermediate_size": 1024, "num_experts": 64,
       "num_experts_per_tok": 8, "vocab_size": 50304}, 6.92e9),
     ({"model_type": "phimoe", "hidden_size": 4096, "num_hidden_layers": 32,
       "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 6400,
       "num_local_experts": 16, "num_experts_per_tok": 2, "vocab_size": 32064}, 41.9e9)],
)  # fmt: skip
def test_other_mixtures_of_experts(
    tmp_path: Path, config: dict[str, object], published: float
) -> None:
    """OLMoE-1B-7B and Phi-3.5-MoE: the experts' width is their intermediate_size."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_shape(tmp_path).parameters == pytest.approx(published, rel=0.005)
