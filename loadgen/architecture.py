"""What a model's `config.json` says about the parts that set its weights and its KV cache, beyond
a dense Llama: mixture-of-experts MLPs, multi-head latent attention (MLA), sliding-window layers,
and the families whose layers keep a per-sequence state instead (Mamba, linear attention).

The facts are vLLM 0.25.1's, read in its source:

- KV pages (`vllm/v1/kv_cache_interface.py`): full and sliding-window attention keep K and V,
  `2 × KV heads per GPU × head dim` values a token and layer; MLA keeps one latent of
  `kv_lora_rank + qk_rope_head_dim` values a token and layer (`MLAAttentionSpec`, one "head"),
  which tensor parallelism does not split: every GPU holds all of it (recorded: DeepSeek-V2-Lite
  at TP = 2 states as many tokens per GiB as at TP = 1).
- A sliding-window layer needs at most `cdiv(min(window − 1 + max_num_batched_tokens,
  max_model_len), block) + 1` blocks a request
  (`SlidingWindowSpec.max_admission_blocks_per_request`).
  The hybrid allocator (`kv_cache_utils._get_kv_cache_groups_uniform_page_size`) puts layers of
  one kind in groups of `group_size` layers (the fewest layers of a kind, or the most when
  that is under 1.5 times the fewest), every group sharing the block pool: blocks =
  KV memory / (page × group_size), and a request at `max_model_len` needs the sum of its groups'
  blocks (`get_max_concurrency_for_kv_cache_config`).
- Experts (`fused_moe/layer.py`): one `w13` [experts, 2 × moe_intermediate, hidden] and one `w2`
  tensor per layer; tensor parallelism splits `moe_intermediate`, expert parallelism
  (`--enable-expert-parallel`) gives each of TP × DP ranks `experts / ranks` whole experts.
- The fused-MoE kernel's workspace (`fused_moe/modular_kernel.py`, `experts/triton_moe.py`):
  `M × top-k × max(moe_intermediate, hidden)` and `M × top-k × max(2 × moe_intermediate, hidden)`
  values, kept from the first MoE layer on; M is the step's tokens, times DP with expert
  parallelism (the ranks' tokens are gathered).
- The model runner: dense models, DeepSeek-V2 and Qwen2-MoE run on the V2 runner, whose CUDA
  graph estimate is 0 (`v1/worker/gpu/model_runner.py`); other MoE models (Qwen3-MoE,
  Mixtral, DeepSeek-V3) on the V1 runner, which measures its graphs at start: partly modelled
  (`config/vllm.py`, `DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TypedDict

MIB = 1 << 20

DENSE = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "granite",
    "olmo2",
    "internlm2", "starcoder2", "exaone", "cohere",
})  # fmt: skip
MOE = frozenset({
    "qwen2_moe", "qwen3_moe", "mixtral", "deepseek", "deepseek_v2", "deepseek_v3", "granitemoe",
    "olmoe", "phimoe",
})  # fmt: skip
# per-sequence state (SSM, linear attention) or attention kinds the worksheet does not size
STATEFUL = frozenset({
    "jamba", "mamba", "mamba2", "qwen3_next", "falcon_h1", "nemotron_h", "bamba",
    "granitemoehybrid", "zamba2", "lfm2", "lfm2_moe", "minimax", "minimax_m1", "plamo2",
    "falcon_mamba", "kimi_linear", "deepseek_v32", "deepseek_v4",
})  # fmt: skip
# vLLM 0.25.1's DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES (DeepseekV2, Qwen2Moe, GraniteMoe)
V2_RUNNER_MOE = frozenset({"deepseek_v2", "qwen2_moe", "granitemoe"})
ARCHITECTURE_TYPES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma2",
    "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral", "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3", "JambaForCausalLM": "jamba",
    "Qwen3NextForCausalLM": "qwen3_next", "MambaForCausalLM": "mamba",
    "OlmoeForCausalLM": "olmoe", "PhiMoEForCausalLM": "phimoe",
}  # fmt: skip


class ArchitectureError(ValueError):
    """A model the worksheet cannot size: said with what is not modelled."""


@dataclass(frozen=True)
class Mla:
    """Multi-head latent attention's projections (DeepSeek V2/V3, Kimi K2)."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None


@dataclass(frozen=True)
class Moe:
    """Routed experts (and shared ones) in every layer but `dense_layers`."""

    experts: int
    top_k: int
    intermediate: int
    shared_intermediate: int
    shared_gate: bool
    dense_layers: tuple[int, ...]


@dataclass(frozen=True)
class Architecture:
    """The layout the worksheet sizes. `layer_kinds` is `full` or `sliding` per layer."""

    family: str
    layer_kinds: tuple[str, ...]
    sliding_window: int | None = None
    mla: Mla | None = None
    moe: Moe | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    norms_per_layer: int = 2
    tied_embeddings: bool = False
    warnings: tuple[str, ...] = field(default=())

    @property
    def attention(self) -> str:
        kinds = set(self.layer_kinds)
        base = "MLA" if self.mla else "full attention (MHA/GQA)"
        if kinds == {"sliding"}:
            return f"sliding window of {self.sliding_window} tokens in every layer"
        if "sliding" in kinds:
            n = self.layer_kinds.count("sliding")
            return (f"{base} in {len(self.layer_kinds) - n} layers, a sliding window of "
                    f"{self.sliding_window} tokens in {n}")  # fmt: skip
        return base

    @property
    def v2_runner(self) -> bool:
        """Whether vLLM 0.25.1 runs it on the V2 model runner (no CUDA graph estimate)."""
        return self.moe is None or self.family in V2_RUNNER_MOE


def _int(config: dict[str, object], *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def family_of(config: dict[str, object]) -> str | None:
    """The config's `model_type`, else the one its first architecture names."""
    kind = config.get("model_type")
    if isinstance(kind, str) and kind:
        return kind
    archs = config.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return ARCHITECTURE_TYPES.get(archs[0], archs[0])
    return None


def _layer_kinds(config: dict[str, object], family: str, layers: int) -> tuple[str, ...]:
    """`full` or `sliding` for each layer, as vLLM builds them: `layer_types` when the config
    has it; Gemma 2's alternation (even layers slide); else every layer slides when the config
    has a window and does not turn it off (`use_sliding_window: false`, Qwen's)."""
    window = _int(config, "sliding_window")
    kinds = config.get("layer_types")
    if isinstance(kinds, list) and len(kinds) == layers:
        other = sorted({str(k) for k in kinds} - {"full_attention", "sliding_attention"})
        if other:
            raise ArchitectureError(
                f"layer_types {', '.join(other)}: layers with a per-sequence state or an "
                "attention kind the worksheet does not model (full and sliding attention only)"
            )
        return tuple("sliding" if k == "sliding_attention" and window else "full" for k in kinds)
    if window is None or config.get("use_sliding_window") is False:
        return ("full",) * layers
    if family == "gemma2":
        return tuple("sliding" if i % 2 == 0 else "full" for i in range(layers))
    if family == "gemma3_text":  # every sliding_window_pattern-th layer global (6: 5 local, 1)
        pattern = _int(config, "sliding_window_pattern") or 6
        return tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(layers))
    return ("sliding",) * layers


def _moe(config: dict[str, object], family: str, layers: int) -> Moe | None:
    experts = _int(config, "n_routed_experts", "num_experts", "num_local_experts")
    if family not in MOE or experts is None:
        return None
    inter = _int(config, "moe_intermediate_size") or _int(config, "intermediate_size") or 0
    shared = _int(config, "shared_expert_intermediate_size") or 0
    if n_shared := _int(config, "n_shared_experts"):
        shared = n_shared * inter
    dense: set[int] = set(range(_int(config, "first_k_dense_replace") or 0))
    # Qwen's decoder_sparse_step: layer i has experts when (i + 1) % step == 0; DeepSeek's
    # moe_layer_freq: when i % freq == 0 (vLLM's qwen2_moe.py and deepseek_v2.py)
    step = _int(config, "decoder_sparse_step") or 1
    freq = _int(config, "moe_layer_freq") or 1
    dense |= {i for i in range(layers) if (i + 1) % step != 0 or i % freq != 0}
    only = config.get("mlp_only_layers")
    if isinstance(only, list):
        dense |= {i for i in only if isinstance(i, int)}
    return Moe(
        experts=experts,
        top_k=_int(config, "num_experts_per_tok", "num_experts_per_token") or 1,
        intermediate=inter,
        shared_intermediate=shared,
        shared_gate=family == "qwen2_moe" and shared > 0,
        dense_layers=tuple(sorted(i for i in dense if i < layers)),
    )


def _mla(config: dict[str, object]) -> Mla | None:
    rank, rope = _int(config, "kv_lora_rank"), _int(config, "qk_rope_head_dim")
    if rank is None or rope is None:
        return None
    return Mla(rank, rope, _int(config, "qk_nope_head_dim") or 0,
               _int(config, "v_head_dim") or 0, _int(config, "q_lora_rank"))  # fmt: skip


def parse(config: dict[str, object], layers: int) -> Architecture:
    """The layout of a model's text config; `ArchitectureError` for one the worksheet does not
    model (a per-sequence state, an unknown `model_type`)."""
    family = family_of(config)
    if family in STATEFUL:
        raise ArchitectureError(
            f"model_type {family!r}: its Mamba or linear-attention layers (or its sparse "
            "attention) keep a per-sequence state that the worksheet does not model; its KV "
            "figures would be wrong, so none are given"
        )
    warnings: list[str] = []
    if family is None:
        family = "llama"
        warnings.append("the config names no model_type or architecture: read as a dense "
                        "Llama-style model")  # fmt: skip
    elif family not in DENSE | MOE:
        known = ", ".join(sorted(DENSE | MOE))
        raise ArchitectureError(
            f"model_type {family!r} is not one the worksheet models (known: {known}); its "
            "weights and KV bytes per token cannot be told from its config. For the KV "
            "arithmetic alone, copy the config with the nearest known model_type"
        )
    if config.get("quantization_config") is not None:
        warnings.append("quantization_config: the config-based weight estimate counts "
                        "unquantized weights; a folder with the checkpoint's safetensors "
                        "headers gives its packed sizes")  # fmt: skip
    return Architecture(
        family=family,
        layer_kinds=_layer_kinds(config, family, layers),
        sliding_window=_int(config, "sliding_window"),
        mla=_mla(config),
        moe=_moe(config, family, layers),
        qkv_bias=bool(config.get("attention_bias") or config.get("qkv_bias"))
        or family in ("qwen2", "qwen2_moe", "phimoe"),
        qk_norm=family in ("qwen3", "qwen3_moe", "gemma3_text", "olmoe"),
        norms_per_layer=4 if family in ("gemma2", "gemma3_text") else 2,
        tied_embeddings=bool(config.get("tie_word_embeddings", family.startswith("gemma"))),
        warnings=tuple(warnings),
    )


# -- weights -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dims:
    """The shape numbers the tensors need (from `capacity.ModelShape`)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int


@dataclass(frozen=True)
class Parallel:
    """How one engine spreads over GPUs: TP, DP and whether experts are spread (EP)."""

    tp: int = 1
    dp: int = 1
    expert_parallel: bool = False

    @property
    def expert_ranks(self) -> int:
        return self.tp * self.dp if self.expert_parallel else 1


def _attention_tensors(arch: Architecture, d: Dims, tp: int) -> list[int]:
    h = d.hidden
    heads = math.ceil(d.heads / tp)
    if arch.mla is not None:
        m = arch.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = ([h * m.q_lora_rank, m.q_lora_rank, m.q_lora_rank * heads * qk] if m.q_lora_rank
             else [h * heads * qk])  # fmt: skip
        return [*q, h * (m.kv_lora_rank + m.qk_rope_head_dim), m.kv_lora_rank,
                m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim),
                heads * m.v_head_dim * h]  # fmt: skip
    kv = max(1, d.kv_heads // tp)
    qkv = h * (heads + 2 * kv) * d.head_dim
    out = [qkv, heads * d.head_dim * h]
    if arch.qkv_bias:
        out.append((heads + 2 * kv) * d.head_dim)
    if arch.qk_norm:
        out += [d.head_dim, d.head_dim]
    return out


def _mlp_tensors(arch: Architecture, d: Dims, layer: int, par: Parallel) -> list[int]:
    h, moe = d.hidden, arch.moe
    if moe is None or layer in moe.dense_layers:
        inter = math.ceil(d.intermediate / par.tp)
        return [h * 2 * inter, inter * h]
    ranks = par.expert_ranks
    local = math.ceil(moe.experts / ranks)
    inter = moe.intermediate if ranks > 1 else math.ceil(moe.intermediate / par.tp)
    out = [moe.experts * h, local * 2 * inter * h, local * h * inter]
    if moe.shared_intermediate:
        shared = math.ceil(moe.shared_intermediate / par.tp)
        out += [h * 2 * shared, shared * h]
    if moe.shared_gate:
        out.append(h)
    return out


def tensors(arch: Architecture, d: Dims, par: Parallel, *, pad_vocab: bool = True) -> list[int]:
    """The values of every weight tensor one GPU holds, as vLLM lays them out (merged QKV and
    gate/up projections, fused experts, the vocabulary padded to a multiple of 64)."""
    vocab = -(-d.vocab // 64) * 64 if pad_vocab else d.vocab
    embed = math.ceil(vocab / par.tp) * d.hidden if pad_vocab else vocab * d.hidden
    out = [embed] if arch.tied_embeddings else [embed, embed]
    out.append(d.hidden)
    for layer in range(d.layers):
        out += _attention_tensors(arch, d, par.tp)
        out += _mlp_tensors(arch, d, layer, par)
        out += [d.hidden] * arch.norms_per_layer
    return out


def parameters(arch: Architecture, d: Dims) -> int:
    """The model's parameters (one copy, unpadded vocabulary)."""
    return sum(tensors(arch, d, Parallel(), pad_vocab=False))


def allocated(nbytes: int) -> int:
    """What torch's CUDA caching allocator takes for one tensor: above 1 MiB a multiple of
    2 MiB, else of 512 bytes."""
    step = 2 * MIB if nbytes > MIB else 512
    return -(-nbytes // step) * step


def weight_bytes_per_gpu(arch: Architecture, d: Dims, par: Parallel, dtype_bytes: int) -> int:
    """One GPU's weights as the allocator holds them."""
    return sum(allocated(n * dtype_bytes) for n in tensors(arch, d, par))


def rounding_bytes(arch: Architecture, d: Dims, par: Parallel, dtype_bytes: int) -> int:
    """What the allocator adds to one GPU's weights (beside a checkpoint's exact bytes)."""
    exact = sum(n * dtype_bytes for n in tensors(arch, d, par))
    return weight_bytes_per_gpu(arch, d, par, dtype_bytes) - exact


# -- activations ---------------------------------------------------------------------------------


def moe_workspace(arch: Architecture, hidden: int, tokens: int, par: Parallel,
                  dtype_bytes: int) -> int:  # fmt: skip
    """The fused-MoE kernel's two workspaces, kept from the first MoE layer on (0 without
    experts): `M × top-k × max(moe_intermediate, hidden)` and `M × top-k × max(2 ×
    moe_intermediate, hidden)` values, M the step's tokens (times DP with expert parallelism)."""
    moe = arch.moe
    if moe is None:
        return 0
    inter = moe.intermediate if par.expert_ranks > 1 else math.ceil(moe.intermediate / par.tp)
    m = tokens * (par.dp if par.expert_parallel else 1)
    return dtype_bytes * m * moe.top_k * (max(inter, hidden) + max(2 * inter, hidden))


def layer_peak(arch: Architecture, d: Dims, tokens: int, *, par: Parallel, dtype_bytes: int) -> int:
    """Bytes live at the busiest point of one decoder layer of an MoE or MLA model for `tokens`
    tokens (per GPU), beside the fused-MoE workspace: the residual stream (2·T·hidden) and the
    larger of attention — QKV, the q/k norms' outputs, the output; MLA's q, kv_b's output and
    the k and v it is split into — and an MLP: a dense layer's gate/up output and activation
    (3·T·intermediate), or an MoE layer's shared experts' (3·T·shared) beside the routed and
    shared outputs (2·T·hidden)."""
    t, tp, moe = tokens, par.tp, arch.moe
    heads = math.ceil(d.heads / tp)
    if arch.mla is not None:
        attention = t * heads * (arch.mla.qk_nope_head_dim + arch.mla.qk_rope_head_dim) * 4
    else:
        kv = max(1, d.kv_heads // tp)
        norms = heads + kv if arch.qk_norm else 0
        attention = t * d.head_dim * ((heads + 2 * kv) + heads + norms)
    mlps = [3 * t * math.ceil(d.intermediate / tp)] if moe is None or moe.dense_layers else []
    if moe is not None:
        mlps.append(3 * t * math.ceil(moe.shared_intermediate / tp) + 2 * t * d.hidden)
    return dtype_bytes * (2 * t * d.hidden + max(attention, *mlps))


FA3_SPLITS = 32  # vLLM's flash_attn_max_num_splits_for_cuda_graph (config/attention.py)


def full_graph_buffers(arch: Architecture, d: Dims, tokens: int, *, tp: int) -> int:
    """What FlashAttention 3 allocates in a FULL CUDA graph of `tokens` decode requests: its
    split-KV accumulators, `[32 splits, heads, tokens, head_dim]` outputs and `[32, heads,
    tokens]` log-sum-exps in float32 (vLLM sets the splits for graph capture; 256 + 2 MiB for
    Qwen3-30B-A3B's 32 heads at 512 tokens, as vLLM measured). MLA's backends keep other
    buffers: 0 for them here."""
    if arch.mla is not None:
        return 0
    heads = math.ceil(d.heads / tp)
    out = FA3_SPLITS * heads * tokens * d.head_dim * 4
    lse = FA3_SPLITS * heads * tokens * 4
    return allocated(out) + allocated(lse)


# -- the KV cache --------------------------------------------------------------------------------


def layer_kv_bytes_per_token(arch: Architecture, d: Dims, tp: int, kv_bytes: int) -> int:
    """One layer's KV bytes a token on one GPU: K and V of its share of the KV heads, or MLA's
    latent, which every GPU holds whole."""
    if arch.mla is not None:
        return (arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim) * kv_bytes
    return 2 * max(1, d.kv_heads // tp) * d.head_dim * kv_bytes


@dataclass(frozen=True)
class KvGroups:
    """vLLM's KV cache groups: each (kind, layers) group has its own block table, all share one
    pool of blocks of `group_size` layers' pages."""

    groups: tuple[str, ...]
    group_size: int
    window: int | None
    max_num_batched_tokens: int

    def blocks_per_request(self, tokens: float, block: int) -> int:
        """Blocks one request of `tokens` tokens holds at most, summed over the groups."""
        full = math.ceil(tokens / block)
        if self.window is None:
            return full * len(self.groups)
        slide = math.ceil(min(self.window - 1 + self.max_num_batched_tokens, tokens) / block) + 1
        return sum(slide if kind == "sliding" else full for kind in self.groups)


def kv_groups(arch: Architecture, max_num_batched_tokens: int) -> KvGroups:
    """The groups vLLM's hybrid allocator makes of the layers (one group when all are alike)."""
    counts = {kind: arch.layer_kinds.count(kind) for kind in dict.fromkeys(arch.layer_kinds)}
    fewest, most = min(counts.values()), max(counts.values())
    size = most if most < fewest * 1.5 else fewest
    groups = tuple(kind for kind, n in counts.items() for _ in range(math.ceil(n / size)))
    window = arch.sliding_window if "sliding" in counts else None
    return KvGroups(groups, size, window, max_num_batched_tokens)


class ArchitectureSummary(TypedDict):
    """The architecture as the worksheet sized it (the JSON's `architecture`)."""

    family: str
    attention: str
    layers_full: int
    layers_sliding: int
    sliding_window: int | None
    kv_cache_groups: int
    kv_cache_group_size: int
    mla: dict[str, int | None] | None
    moe: dict[str, object] | None


def summary(arch: Architecture, groups: KvGroups) -> ArchitectureSummary:
    return {
        "family": arch.family,
        "attention": arch.attention,
        "layers_full": arch.layer_kinds.count("full"),
        "layers_sliding": arch.layer_kinds.count("sliding"),
        "sliding_window": arch.sliding_window if "sliding" in arch.layer_kinds else None,
        "kv_cache_groups": len(groups.groups),
        "kv_cache_group_size": groups.group_size,
        "mla": asdict(arch.mla) if arch.mla else None,
        "moe": asdict(arch.moe) if arch.moe else None,
    }
