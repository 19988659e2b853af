"""The capacity worksheet and KV-cache memory math, from a model's `config.json`.

KV bytes per token = 2 (K, V) × layers × KV heads (per GPU) × head dim × bytes per value. vLLM
then cuts its KV space into blocks of `block_size` tokens (one page per layer), and states its
capacity as a request of `max_model_len` tokens needs ceil(max_model_len / block_size) blocks:
max concurrency = blocks / that, KV tokens = int(max concurrency × max_model_len)
(`vllm/v1/core/kv_cache_utils.py`, `get_kv_cache_capacity`). This module does the same sums, so
its numbers can be checked against the line vLLM logs at start-up (`wire.kv_statement`).

With tensor parallelism each GPU holds max(1, KV heads / TP) heads of every layer (vLLM replicates
KV heads when TP exceeds them) and its own KV space: per-GPU numbers are what bound concurrency.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from servescope.loadgen import architecture, checkpoint, gpu_memory
from servescope.loadgen.architecture import Architecture, Dims
from servescope.loadgen.checkpoint import Checkpoint
from servescope.store import Store

GIB = 1 << 30
DTYPE_BYTES = {
    "float32": 4, "fp32": 4, "float": 4,
    "float16": 2, "fp16": 2, "half": 2, "bfloat16": 2, "bf16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "int8": 1, "uint8": 1,
}  # fmt: skip
CPU_BLOCK_SIZE = 128  # vLLM-CPU's default block size
GPU_BLOCK_SIZE = 16  # vLLM's default on CUDA


class CapacityError(ValueError):
    """A model folder or config that cannot be read, or settings that cannot be sized."""


@dataclass(frozen=True)
class ModelShape:
    """What the KV cache and the weights depend on, read from `config.json`."""

    name: str
    layers: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    hidden_size: int
    dtype: str | None
    parameters: int | None
    parameters_basis: str
    max_position_embeddings: int | None
    intermediate_size: int | None = None
    vocab_size: int | None = None
    architecture: Architecture | None = None
    checkpoint: Checkpoint | None = None

    def dims(self) -> Dims:
        return Dims(self.layers, self.hidden_size, self.attention_heads,
                                 self.kv_heads, self.head_dim, self.intermediate_size or 0,
                                 self.vocab_size or 0)  # fmt: skip

    def arch(self) -> Architecture:
        """The layout (a dense Llama's full attention when none was read)."""
        return self.architecture or Architecture("llama", ("full",) * self.layers)


@dataclass(frozen=True)
class Settings:
    """The serving flags the arithmetic needs (vLLM's names), and where the KV space comes from:
    `kv_cache_gib` (vLLM-CPU's `VLLM_CPU_KVCACHE_SPACE`, or a GPU's `--kv-cache-memory`), or
    GPU memory × utilization less what vLLM subtracts (`loadgen/gpu_memory.py`: weights,
    activation peak, non-torch memory, CUDA graphs) and `overhead_gib` (anything else the
    GPU holds). `device` (`cpu`, `cuda`; `auto`: cuda with `gpu_memory_gib`) sets the
    default block size. `gpu_name` (a card's or NVML's) picks vLLM's scheduler defaults (an A100
    keeps the small ones); `gpu_memory_source` says where `gpu_memory_gib` was read. Each of
    `data_parallel_size` engines holds a whole copy of the model on its own GPUs and sizes its
    own KV cache: the numbers are per engine, the totals of all engines beside them. With
    `enable_expert_parallel` the routed experts are spread whole over TP × DP ranks."""

    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    kv_cache_gib: float | None = None
    gpu_memory_gib: float | None = None
    gpu_memory_utilization: float = 0.9
    overhead_gib: float = 0.0
    block_size: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    enforce_eager: bool = False
    device: str = "auto"
    gpu_name: str | None = None
    gpu_memory_source: str | None = None
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False


def _config_path(model: Path) -> Path:
    path = model / "config.json" if model.is_dir() else model
    if not path.is_file():
        raise CapacityError(f"no config.json at {path}")
    return path


def _int(config: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _architecture(config: dict[str, Any], layers: int, path: Path) -> architecture.Architecture:
    try:
        return architecture.parse(config, layers)
    except architecture.ArchitectureError as exc:
        raise CapacityError(f"{path}: {exc}") from None


def _estimate_basis(arch: architecture.Architecture) -> str:
    """What the config-based parameter count took into account."""
    parts = []
    if (moe := arch.moe) is not None:
        shared = f" + shared ({moe.shared_intermediate:,} wide)" if moe.shared_intermediate else ""
        dense = f", {len(moe.dense_layers)} dense layer(s)" if moe.dense_layers else ""
        parts.append(f"{moe.experts} routed experts{shared}{dense}")
    if arch.mla is not None:
        parts.append("MLA projections")
    parts.append("tied embeddings" if arch.tied_embeddings else "untied LM head")
    return f"config.json (architecture-aware estimate: {', '.join(parts)})"


def load_shape(model: Path) -> ModelShape:
    """The shape of the model in a folder (or of a bare `config.json`); its weights from the
    checkpoint's safetensors headers when the folder has them, else estimated from the config
    for its architecture."""
    path = _config_path(model)
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CapacityError(f"cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise CapacityError(f"{path} is not a JSON object")
    outer, config = config, config.get("text_config") or config
    layers = _int(config, "num_hidden_layers", "n_layer", "num_layers")
    heads = _int(config, "num_attention_heads", "n_head")
    hidden = _int(config, "hidden_size", "n_embd", "d_model")
    if layers is None or heads is None or hidden is None:
        raise CapacityError(f"{path} lacks num_hidden_layers, num_attention_heads or hidden_size")
    arch = _architecture(config, layers, path)
    if "vision_config" in outer:
        arch = replace(
            arch,
            warnings=(
                *arch.warnings,
                "the vision encoder's weights (and the "
                "memory of its profile run) are not counted: the language model's only",
            ),
        )
    dtype = config.get("torch_dtype") or config.get("dtype")
    try:
        found = checkpoint.read(path.parent)
    except checkpoint.CheckpointError as exc:
        raise CapacityError(str(exc)) from None
    shape = ModelShape(
        name=model.name
        if model.is_dir()
        else model.parent.name
        if model.name == "config.json"
        else model.stem,
        layers=layers,
        attention_heads=heads,
        kv_heads=_int(config, "num_key_value_heads", "num_kv_heads") or heads,
        head_dim=_int(config, "head_dim") or hidden // heads,
        hidden_size=hidden,
        dtype=str(dtype) if dtype else None,
        parameters=None,
        parameters_basis="unknown",
        max_position_embeddings=_int(config, "max_position_embeddings", "n_positions"),
        intermediate_size=_int(config, "intermediate_size", "n_inner", "ffn_dim"),
        vocab_size=_int(config, "vocab_size"),
        architecture=arch,
        checkpoint=found,
    )
    if found is not None and found.parameters:
        return replace(shape, parameters=found.parameters, parameters_basis=found.basis)
    if shape.vocab_size is None or (shape.intermediate_size is None and arch.moe is None):
        return shape
    estimated = architecture.parameters(arch, shape.dims())
    basis = _estimate_basis(arch) if found is None else f"{found.basis}; parameters from the " \
        "config"  # fmt: skip
    return replace(shape, parameters=estimated, parameters_basis=basis)


def dtype_bytes(name: str, what: str) -> int:
    size = DTYPE_BYTES.get(name.lower().removeprefix("torch."))
    if size is None:
        raise CapacityError(f"unknown {what} {name!r}; known: {', '.join(sorted(DTYPE_BYTES))}")
    return size


def kv_heads_per_gpu(shape: ModelShape, tp: int) -> int:
    """vLLM's `get_num_kv_heads`: heads split across TP ranks, at least one per rank."""
    return max(1, shape.kv_heads // tp)


def kv_bytes_per_token(shape: ModelShape, kv_bytes: int, tp: int = 1) -> int:
    """One GPU's KV bytes a token over all layers: 2 (K, V) × KV heads per GPU × head dim ×
    bytes per value a layer, or MLA's latent (`kv_lora_rank + qk_rope_head_dim` values a
    layer, whole on every GPU)."""
    layer = architecture.layer_kv_bytes_per_token(shape.arch(), shape.dims(), tp, kv_bytes)
    return shape.layers * layer


def _resolved(shape: ModelShape, settings: Settings) -> tuple[str, str, int]:
    dtype = settings.dtype
    if dtype == "auto":
        # vLLM's `auto`: the config's dtype, but a float32 model is downcast to the platform's
        # first choice (bfloat16 on CUDA and on vLLM-CPU); `_resolve_auto_dtype`
        dtype = shape.dtype or "bfloat16"
        if dtype.lower().removeprefix("torch.") in ("float32", "fp32", "float"):
            dtype = "bfloat16"
    kv_dtype = dtype if settings.kv_cache_dtype == "auto" else settings.kv_cache_dtype
    max_len = settings.max_model_len or shape.max_position_embeddings
    if not max_len:
        raise CapacityError("give --max-model-len (the config has no max_position_embeddings)")
    return dtype, kv_dtype, max_len


def device_of(settings: Settings) -> str:
    if settings.device != "auto":
        return settings.device
    return "cuda" if settings.gpu_memory_gib is not None else "cpu"


@dataclass(frozen=True)
class Weights:
    """The weights' bytes: the model's and one GPU's (allocator rounding included when
    `rounded`), and where they come from."""

    total: int | None
    per_gpu: int | None
    rounded: bool


def _weights(shape: ModelShape, settings: Settings, dtype: str) -> Weights:
    """From the checkpoint's headers when read, else parameters × dtype: split over TP (experts
    over the expert ranks); an MoE or MLA model as vLLM lays out each tensor."""
    size = dtype_bytes(dtype, "--dtype")
    par = _parallel(settings)
    arch = shape.arch()
    sized = bool(arch.moe or arch.mla) and bool(shape.vocab_size)
    if shape.checkpoint is not None:
        ckpt = shape.checkpoint
        per_gpu = ckpt.bytes_per_gpu(size, par.tp, par.expert_ranks)
        if sized:  # the allocator's rounding of each tensor as vLLM lays them out
            per_gpu += architecture.rounding_bytes(arch, shape.dims(), par, size)
        return Weights(ckpt.total_bytes(size), per_gpu, rounded=sized)
    if not shape.parameters:
        return Weights(None, None, rounded=False)
    if sized:
        per_gpu = architecture.weight_bytes_per_gpu(arch, shape.dims(), par, size)
        return Weights(shape.parameters * size, per_gpu, rounded=True)
    return Weights(shape.parameters * size, math.ceil(shape.parameters * size / par.tp), False)


def _parallel(settings: Settings) -> architecture.Parallel:
    return architecture.Parallel(settings.tensor_parallel_size, settings.data_parallel_size,
                                 settings.enable_expert_parallel)  # fmt: skip


def _kv_space(
    shape: ModelShape, settings: Settings, weights: Weights, dtype: str
) -> tuple[int | None, str, gpu_memory.GpuMemory | None]:
    if settings.kv_cache_gib is not None:
        return int(settings.kv_cache_gib * GIB), "--kv-cache-gib", None
    if settings.gpu_memory_gib is None:
        return None, "not given (--kv-cache-gib, or --gpu-memory-gib)", None
    if weights.per_gpu is None:
        raise CapacityError("the weights' size is unknown: give --kv-cache-gib instead")
    if shape.intermediate_size is None or shape.vocab_size is None:
        raise CapacityError("the config lacks intermediate_size or vocab_size: give --kv-cache-gib")
    arch, size = shape.arch(), dtype_bytes(dtype, "--dtype")
    total = int(settings.gpu_memory_gib * GIB)
    tokens = settings.max_num_batched_tokens or gpu_memory.scheduler_defaults(
        settings.gpu_memory_gib, settings.gpu_name)[0]  # fmt: skip
    sized = arch.moe is not None or arch.mla is not None
    par = _parallel(settings)
    model = gpu_memory.predict(
        gpu_memory.Shape(shape.layers, shape.hidden_size, shape.intermediate_size,
                         shape.attention_heads, shape.kv_heads, shape.head_dim, shape.vocab_size),
        total_bytes=total,
        utilization=settings.gpu_memory_utilization,
        weight_bytes=weights.per_gpu,
        dtype_bytes=size,
        tp=settings.tensor_parallel_size,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_seqs=settings.max_num_seqs,
        cudagraphs=not settings.enforce_eager and not (sized and arch.v2_runner),
        extra_bytes=int(settings.overhead_gib * GIB),
        device_name=settings.gpu_name,
        weights_rounded=weights.rounded,
        persistent_bytes=architecture.moe_workspace(arch, shape.hidden_size, tokens, par, size),
        non_torch_bytes=int(gpu_memory.NON_TORCH_SIZED_GIB * GIB) if sized else None,
        layer_of=partial(architecture.layer_peak, arch, shape.dims(), par=par, dtype_bytes=size)
        if sized else None,
        graph_first_of=partial(architecture.full_graph_buffers, arch, shape.dims(), tp=par.tp)
        if sized and not arch.v2_runner else None,
    )  # fmt: skip
    basis = (
        "GPU memory × gpu_memory_utilization − weights − activation peak − non-torch memory − "
        "CUDA graphs − overhead, as vLLM profiles them (loadgen/gpu_memory.py)"
    )
    return model.available, basis, model


@dataclass(frozen=True)
class Traffic:
    p50_prompt_tokens: float | None = None
    p95_prompt_tokens: float | None = None
    p50_output_tokens: float | None = None
    p95_output_tokens: float | None = None


def _zero_reason(memory: gpu_memory.GpuMemory | None, blocks: int, fits: bool, page: int,
                 block: int) -> str | None:  # fmt: skip
    """Why no request fits, when none does: never a bare 0."""
    if memory is not None and memory.available <= 0:
        return (f"no KV cache: the weights ({memory.weights / GIB:.2f} GiB a GPU) and what vLLM "
                f"subtracts with them exceed GPU memory × utilization "
                f"({memory.requested / GIB:.2f} GiB); vLLM would not start. More GPUs "
                "(--tensor-parallel-size, --enable-expert-parallel), a higher "
                "--gpu-memory-utilization, or a quantized checkpoint")  # fmt: skip
    if blocks == 0:
        return f"the KV space holds less than one block of {block} tokens ({page:,} B)"
    if not fits:
        return "max_model_len does not fit: not one request of max_model_len tokens fits"
    return None


def _graph_warning(shape: ModelShape, terms: gpu_memory.GpuMemory | None) -> list[str]:
    """What the GPU terms do not model: the CUDA graphs of an MoE model on vLLM's V1 runner."""
    arch = shape.arch()
    if terms is None or not terms.cudagraph_sizes or arch.moe is None or arch.v2_runner:
        return []
    return [
        "CUDA graph memory only partly modelled for this model: vLLM 0.25.1 runs it on its V1 "
        "model runner, which measures its CUDA graphs at start-up; the worksheet counts the "
        "first FULL capture's FlashAttention buffers but a floor of 1 MiB for each other graph, "
        "where vLLM measured 6 MiB for each piecewise one (Qwen3-30B-A3B on an H200: 0.64 GiB "
        "measured, 0.35 GiB here: a KV space about 0.3 GiB larger than vLLM's, +0.6 %; "
        "tests/fixtures/gpu3). With --enforce-eager there are no graphs."
    ]


def compute(
    shape: ModelShape,
    settings: Settings,
    traffic: Traffic | None = None,
    *,
    block_size_default: int | None = None,
) -> dict[str, Any]:
    """The filled worksheet's numbers: weights, KV bytes per token, blocks, KV tokens, max
    concurrency at `max_model_len` (vLLM's statement) and at the p50/p95 request shapes."""
    tp, dp = settings.tensor_parallel_size, settings.data_parallel_size
    if tp < 1 or dp < 1:
        raise CapacityError("--tensor-parallel-size and --data-parallel-size must be at least 1")
    dtype, kv_dtype, max_len = _resolved(shape, settings)
    kv_size = dtype_bytes(kv_dtype, "--kv-cache-dtype")
    weights = _weights(shape, settings, dtype)
    per_token = kv_bytes_per_token(shape, kv_size, tp)
    default_block = CPU_BLOCK_SIZE if device_of(settings) == "cpu" else GPU_BLOCK_SIZE
    block = settings.block_size or block_size_default or default_block
    space, basis, terms = _kv_space(shape, settings, weights, dtype)
    memory = terms.gib() if terms else None
    batched = terms.max_num_batched_tokens if terms else settings.max_num_batched_tokens
    groups = architecture.kv_groups(shape.arch(), batched or 2048)
    model = {k: v for k, v in asdict(shape).items() if k not in ("architecture", "checkpoint")}
    out: dict[str, Any] = {
        "model": {**model, "weight_bytes": weights.total, "weight_bytes_per_gpu": weights.per_gpu,
                  "kv_heads_per_gpu": kv_heads_per_gpu(shape, tp),
                  "expert_parallel": settings.enable_expert_parallel},
        "architecture": architecture.summary(shape.arch(), groups),
        "settings": {**asdict(settings), "dtype": dtype, "kv_cache_dtype": kv_dtype,
                     "max_model_len": max_len, "block_size": block,
                     "device": device_of(settings)},
        "kv_bytes_per_token": per_token,
        "kv_bytes_per_token_all_gpus": per_token * tp,
        "kv_bytes_per_sequence_at_max_model_len": per_token * max_len,
        "kv_cache_bytes": space,
        "kv_cache_bytes_basis": basis,
        "gpu_memory": memory,
        "kv_blocks": None,
        "kv_tokens": None,
        "kv_tokens_reason": None,
        "max_concurrency": None,
        "max_model_len_fits": None,
        "kv_tokens_all_engines": None,
        "max_concurrency_all_engines": None,
        "gpus": tp * dp,
        "concurrency_at": {},
        "warnings": [*shape.arch().warnings, *_graph_warning(shape, terms)],
    }  # fmt: skip
    if space is None:
        return out
    # one page of `block` tokens in each layer of a group; the groups share the blocks
    blocks = space // (per_token // shape.layers * block * groups.group_size)
    conc = blocks / groups.blocks_per_request(max_len, block)
    out.update(
        kv_blocks=blocks,
        kv_tokens=int(conc * max_len),
        max_concurrency=round(conc, 4),
        max_model_len_fits=blocks >= groups.blocks_per_request(max_len, block),
        kv_tokens_all_engines=int(conc * max_len) * dp,
        max_concurrency_all_engines=round(conc * dp, 4),
    )
    reason = _zero_reason(terms, blocks, bool(out["max_model_len_fits"]),
                          per_token // shape.layers * block * groups.group_size, block)  # fmt: skip
    if reason is not None:
        out["kv_tokens_reason"] = reason
        out["warnings"].append(reason)
    if traffic is not None:
        for q in ("p50", "p95"):
            prompt = getattr(traffic, f"{q}_prompt_tokens")
            output = getattr(traffic, f"{q}_output_tokens")
            if prompt is not None and output is not None:
                shape_tokens = prompt + output
                out["concurrency_at"][q] = {
                    "tokens_per_request": shape_tokens,
                    "max_concurrency": round(
                        blocks / groups.blocks_per_request(shape_tokens, block), 4),
                }  # fmt: skip
    return out


# -- from a stored run ---------------------------------------------------------------------------


def run_traffic(store: Store, run_id: str) -> dict[str, Any]:
    """A stored run's request shape and measured speed: p50/p95 prompt and output tokens,
    TTFT p95, ITL p95, tokens per second (successful requests)."""
    from servescope.store import reads

    with store.read() as con:
        found = reads.run_traffic(con, run_id)
    if not found["requests"]:
        raise CapacityError(f"run {run_id!r} has no successful requests in the store")
    prompt, output = found["prompt_q"] or [None, None], found["output_q"] or [None, None]
    seconds = found["seconds"]
    return {
        "run_id": run_id,
        "requests": found["requests"],
        "traffic": Traffic(prompt[0], prompt[1], output[0], output[1]),
        "ttft_p95_ms": found["ttft_p95"],
        "itl_p95_ms": found["itl_p95"],
        "tokens_per_s": found["tokens"] / seconds if found["tokens"] and seconds else None,
    }


def cost_per_1k_tokens(gpu_hour_usd: float, gpus: int, tokens_per_s: float | None) -> float | None:
    """What 1,000 tokens (prompt + output) cost at the measured throughput on `gpus` GPUs."""
    if not tokens_per_s:
        return None
    return gpu_hour_usd * gpus / 3600.0 / tokens_per_s * 1000.0


def worksheet(
    result: dict[str, Any],
    traffic: Traffic,
    targets: dict[str, Any],
    measured: dict[str, Any] | None,
    tuning: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The capacity worksheet (model, parameters, dtype, max_model_len, traffic, targets, tuning)
    filled in, plus the capacity it implies."""
    model, settings = result["model"], result["settings"]
    tuning = tuning or {}
    return {
        "model": model["name"],
        "parameters": model["parameters"],
        "dtype": settings["dtype"],
        "max_model_len": settings["max_model_len"],
        "traffic": asdict(traffic),
        "targets": targets,
        "tuning": {
            "tensor_parallel_size": settings["tensor_parallel_size"],
            "data_parallel_size": settings["data_parallel_size"],
            "gpu_memory_utilization": settings["gpu_memory_utilization"]
            if settings["gpu_memory_gib"] is not None else None,
            "enable_prefix_caching": tuning.get("enable_prefix_caching"),
            "speculative_config": tuning.get("speculative_config"),
        },
        "capacity": {
            "weight_bytes": model["weight_bytes"],
            "kv_bytes_per_token": result["kv_bytes_per_token"],
            "kv_tokens": result["kv_tokens"],
            "kv_blocks": result["kv_blocks"],
            "block_size": settings["block_size"],
            "max_concurrency": result["max_concurrency"],
            "max_model_len_fits": result["max_model_len_fits"],
            "kv_tokens_all_engines": result["kv_tokens_all_engines"],
            "concurrency_at": result["concurrency_at"],
        },
        "measured": measured,
    }  # fmt: skip


def settings_of(levers: Mapping[str, object], **given: Any) -> Settings:
    """The arithmetic's settings for a server started with these flags (vLLM's `non-default
    args`, or the launcher's levers: vLLM's names); `given` sets what flags do not hold (the KV
    space, the GPU's total and name)."""

    def num(key: str, cast: type) -> Any:
        value = levers.get(key)
        try:
            return cast(value) if value not in (None, True, False) else None
        except (TypeError, ValueError):
            return None

    found: dict[str, Any] = {
        "dtype": str(levers.get("dtype") or "auto"),
        "kv_cache_dtype": str(levers.get("kv_cache_dtype") or "auto"),
        "max_model_len": num("max_model_len", int),
        "tensor_parallel_size": num("tensor_parallel_size", int) or 1,
        "data_parallel_size": num("data_parallel_size", int) or 1,
        "block_size": num("block_size", int),
        "max_num_batched_tokens": num("max_num_batched_tokens", int),
        "max_num_seqs": num("max_num_seqs", int),
        "enforce_eager": levers.get("enforce_eager") is True,
        "enable_expert_parallel": levers.get("enable_expert_parallel") is True,
    }
    if (utilization := num("gpu_memory_utilization", float)) is not None:
        found["gpu_memory_utilization"] = utilization
    return Settings(**{**found, **given})


def from_levers(
    model: Path, levers: Mapping[str, object], env: dict[str, str]
) -> dict[str, float | int | str | None] | None:
    """servescope's numbers for a server the launcher started (its flags and environment), to
    record next to vLLM's own statement; None when the model is not a local folder; with
    `not_modelled` (and no numbers) when the worksheet cannot size it, said rather than left
    blank."""
    if not _config_path_exists(model):
        return None
    space = env.get("VLLM_CPU_KVCACHE_SPACE")
    settings = settings_of(levers, kv_cache_gib=float(space) if space else None)
    try:
        result = compute(load_shape(model), settings)
    except (CapacityError, ValueError) as exc:
        return {"kv_tokens": None, "max_concurrency": None, "not_modelled": str(exc)}
    return {
        "kv_bytes_per_token": result["kv_bytes_per_token"],
        "kv_tokens": result["kv_tokens"],
        "max_concurrency": result["max_concurrency"],
        "max_model_len": result["settings"]["max_model_len"],
        "block_size": result["settings"]["block_size"],
        "kv_cache_bytes": result["kv_cache_bytes"],
    }


def _config_path_exists(model: Path) -> bool:
    return (model / "config.json").is_file() if model.is_dir() else model.is_file()
