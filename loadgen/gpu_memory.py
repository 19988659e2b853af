"""What vLLM subtracts from a GPU's memory before the KV cache, modelled from first principles.

vLLM (0.2x, `v1/worker/gpu_worker.py` `determine_available_memory`) sizes its KV cache once, at
start-up:

    available = ceil(total × gpu_memory_utilization)
                − weights − activation peak − non-torch increase − CUDA graph estimate

where `total` is the device memory CUDA reports (`cudaMemGetInfo`), the weights are what model
loading allocated, the activation peak is the rise of torch's allocated-bytes peak during one
dummy forward pass of `max_num_batched_tokens` tokens and one sampler pass over `max_num_seqs`
dummy requests (`profile_run`), the non-torch increase is device memory allocated outside
torch since the worker's first snapshot (taken after the CUDA context and NCCL exist, so
neither counts), and the CUDA graph estimate is what capturing the first (largest) graph of
each mode and one more graph cost, the latter times the graphs left
(`profile_cudagraph_memory`; on since v0.21, `VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS`).

Each term here is computed from the model's shape and the flags, never fitted to a
measurement:

- weights: parameters × dtype bytes (÷ tensor-parallel size), each tensor as torch's caching
  allocator holds it (above 1 MiB, a multiple of 2 MiB: a 13B shape's down projections of
  135 MiB take 136), the vocabulary padded to a multiple of 64 as vLLM's embedding pads it.
- activation peak: the largest of one decoder layer's live tensors for T tokens — the residual
  stream (2 × T × hidden), the MLP's gate/up output (T × 2 × intermediate) while its activation
  output (T × intermediate) is written, or attention's QKV (T × (heads + 2 × KV heads) × head
  dim) beside its output (T × heads × head dim) — and the sampler's: logits of `max_num_seqs`
  requests in float32 with softmax, sort values and int64 sort indices for top-k/top-p
  (4 + 4 + 4 + 8 bytes per logit, plus the dtype's logits) beside the forward pass's output
  (T × hidden), whichever is larger, plus torch's cuBLAS workspace
  (32 MiB on Hopper, `:4096:8`), which it allocates on the first GEMM.
- non-torch: the CUDA kernel images loaded on first use during the profile run (cuBLAS/cuBLASLt,
  FlashAttention, vLLM's and inductor's kernels): `NON_TORCH_GIB`, a stated assumption (vLLM
  logs report 0.1–0.3 GiB for a dense model at TP 1); the one term the shape cannot give.
- NCCL's buffers, with tensor parallelism: NCCL (2.22 on) connects an algorithm's channels on
  their first use. vLLM's communicator warms up with a one-element all-reduce before its
  snapshot, which a small-message algorithm carries; the profile run's first large all-reduce
  (T × hidden, the row-parallel layers' output) then connects the ring, allocating outside
  torch, after the snapshot, one buffer per protocol in every channel: Simple 4 MiB
  (`NCCL_BUFFSIZE`), LL128 4.6875 MiB (120 × 640 threads × 8 steps × 8 bytes), LL 0.5 MiB
  (8 × 512 × 8 × 16 bytes), on each GPU. NCCL opens 32 channels for a ring of NVLink-connected
  Hopper or Ampere GPUs (its `32 coll channels` line on an HGX H100); a ring over PCIe, 2 (an
  assumption, not measured here): `Card.nccl_channels`, 32 for a card not in `CARDS`. Data
  parallelism alone connects no such ring (its engines agree on batch sizes over the CPU).
- CUDA graphs: the capture sizes vLLM picks (1, 2, 4, then every 8 up to 256, every 16 up to
  `max_cudagraph_capture_size` = min(2 × max_num_seqs, 512, max_num_batched_tokens)), each
  captured once PIECEWISE and once FULL (FULL_AND_PIECEWISE, the default); the first capture
  holds one step's activations at the largest size in the graph pool, every further graph
  costs at least vLLM's own floor of 1 MiB.

`benchmarks/bench_capacity_gpu.py` measures each term on a GPU server (vLLM's debug line
"Memory profiling takes … Total non KV cache memory … torch peak memory increase …
non-torch forward increase memory … weights memory …" and "Estimated CUDA graph memory"),
so a wrong term shows by itself.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

GIB = 1 << 30
MIB = 1 << 20
CUBLAS_WORKSPACE = 32 * MIB  # torch's default on sm90: 8 chunks of 4 MiB
NON_TORCH_GIB = 0.10  # assumption, see the module docstring
# MoE and MLA models: vLLM's own DEBUG memory line ("non-torch forward increase memory") on each
# recorded one-GPU start of such a model on vLLM 0.25.1 (tests/fixtures/gpu3), their kernels'
# images (fused MoE, MLA) counted; a reading of that term, not of the KV result
NON_TORCH_SIZED_GIB = 0.22
GRAPH_FLOOR = 1 * MIB  # vLLM's minimum per captured graph
# NCCL's buffers of one connection, one per protocol (see the module docstring)
NCCL_PROTOCOL_BUFFERS = 4 * MIB + 120 * 640 * 8 * 8 + 8 * 512 * 8 * 16
NVLINK_CHANNELS = 32  # NCCL's channels for a ring of NVLink-connected GPUs
PCIE_CHANNELS = 2  # and for one over PCIe
SAMPLER_BYTES_PER_LOGIT = 4 + 4 + 4 + 8  # float32 logits, probs, sorted values; int64 indices
LARGE_GPU_GIB = 70  # vLLM's larger defaults above this (H100/H200/MI300; A100-80GB excepted)


@dataclass(frozen=True)
class Shape:
    """The model dimensions the activation terms need."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int


@dataclass(frozen=True)
class GpuMemory:
    """Each term in bytes (per GPU), and the KV space they leave."""

    total: int
    requested: int
    weights: int
    activation_peak: int
    non_torch: int
    nccl: int
    cudagraphs: int
    extra: int
    available: int
    max_num_batched_tokens: int
    max_num_seqs: int
    cudagraph_sizes: int

    def gib(self) -> dict[str, Any]:
        return {
            k: round(v / GIB, 3) if isinstance(v, int) and k not in _COUNTS else v
            for k, v in asdict(self).items()
        }


_COUNTS = {"max_num_batched_tokens", "max_num_seqs", "cudagraph_sizes"}


def scheduler_defaults(total_gib: float, device_name: str | None = None) -> tuple[int, int]:
    """vLLM's API-server defaults (max_num_batched_tokens, max_num_seqs) for a GPU this big
    (`EngineArgs.get_batch_defaults`): the larger ones from 70 GiB up, except on an A100, where
    they cost throughput."""
    a100 = device_name is not None and "a100" in device_name.lower()
    return (8192, 1024) if total_gib >= LARGE_GPU_GIB and not a100 else (2048, 256)


# -- the total vLLM multiplies by its utilization ------------------------------------------------


@dataclass(frozen=True)
class Card:
    """A GPU model's memory as two tools report it. nvidia-smi's total counts memory the driver
    reserves for itself; CUDA's (`cudaMemGetInfo`, `torch.cuda.mem_get_info`) does not, and it is
    CUDA's that vLLM multiplies by `--gpu-memory-utilization`. The two differ by 0.5-0.8 GiB,
    which is 1-2 % of an 8B model's KV cache; `source` says where `cuda_gib` was read. Drivers
    reserve a little more or less (±0.1 GiB between releases)."""

    name: str
    aliases: tuple[str, ...]
    nvidia_smi_mib: int
    cuda_gib: float
    source: str
    nccl_channels: int = NVLINK_CHANNELS  # a ring of these cards (PCIE_CHANNELS without NVLink)


_PUBLISHED = (
    "PyTorch's out-of-memory messages on this card ('GPU 0 has a total capacity of {gib} GiB'), "
    "as published"
)
CARDS = (
    Card("H100-80GB", ("H100", "H100-SXM", "H100-PCIE", "H100-80GB-HBM3"), 81_559, 79.18,
         "recorded here, nvidia-smi -q of an H100 80GB HBM3, driver 580: 81,559 MiB less 480 "
         "reserved (tests/fixtures/gpu/nvidia-smi-q.txt)"),
    Card("H100-94GB", ("H100-NVL", "H100NVL"), 95_830, 93.10, _PUBLISHED),
    Card("H200", ("H200-141GB", "H200-SXM"), 143_771, 139.80,
         "recorded here, nvidia-smi -q of two H200s, driver 580: 143,771 MiB less 616 reserved; "
         "NVML's total less reserved, 150,109,880,320 B, is torch's total to the byte "
         "(tests/fixtures/gpu2)"),
    Card("B200", ("B200-180GB",), 183_359, 178.35, _PUBLISHED),
    Card("A100-80GB", ("A100-SXM4-80GB", "A100-PCIE-80GB"), 81_920, 79.15, _PUBLISHED),
    Card("A100-40GB", ("A100", "A100-SXM4-40GB", "A100-PCIE-40GB"), 40_960, 39.39, _PUBLISHED),
    Card("L40S", (), 46_068, 44.39, _PUBLISHED, PCIE_CHANNELS),
    Card("L4", (), 23_034, 22.03, _PUBLISHED, PCIE_CHANNELS),
    Card("A10G", (), 23_028, 22.06, _PUBLISHED, PCIE_CHANNELS),
    Card("T4", ("TESLA-T4",), 15_360, 14.75, _PUBLISHED, PCIE_CHANNELS),
)  # fmt: skip


def _key(name: str) -> str:
    """A card's name as people and NVML spell it, reduced to one spelling: `NVIDIA H100 80GB
    HBM3`, `h100_80gb_hbm3` → `H100-80GB-HBM3`."""
    words = re.sub(r"[^A-Za-z0-9]+", " ", name).upper().split()
    return "-".join(w for w in words if w != "NVIDIA")


def card(name: str) -> Card | None:
    """The card of that name (or alias, in any spelling); None when it is not in `CARDS`."""
    wanted = _key(name)
    return next((c for c in CARDS if wanted in (_key(c.name), *map(_key, c.aliases))), None)


def card_source(found: Card) -> str:
    """Where the card's CUDA total comes from, said in full."""
    return found.source.format(gib=f"{found.cuda_gib:.2f}")


def card_names() -> str:
    return ", ".join(c.name for c in CARDS)


def cuda_total(nvml_total: int, nvml_reserved: int) -> int:
    """The total CUDA reports, from NVML's memory statement (v2): its total less the memory the
    driver reserves (recorded on two H200s: 150,754,820,096 − 644,939,776 B = torch's
    150,109,880,320 B)."""
    return nvml_total - nvml_reserved


def nvml_cuda_total() -> tuple[int, str] | None:
    """The memory CUDA reports on the GPU this process would use (the first of
    `CUDA_VISIBLE_DEVICES`, a MIG slice's own when it names one), read through NVML: its total
    less what the driver reserves (`nvmlDeviceGetMemoryInfo` v2), with the device's name. None
    without NVML or a visible GPU. NVML needs no CUDA context, so asking costs no GPU memory."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        first = visible.split(",")[0].strip() if visible is not None else "0"
        if first.isdigit():
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(first))
        elif first.startswith(("GPU-", "MIG-")):
            handle = pynvml.nvmlDeviceGetHandleByUUID(first)
        else:
            return None  # "", "-1": no GPU visible to CUDA
        info = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        name = pynvml.nvmlDeviceGetName(handle)
        total = cuda_total(int(info.total), int(info.reserved))
        return total, name.decode() if isinstance(name, bytes) else str(name)
    except pynvml.NVMLError:
        return None
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def nccl_buffers(tp: int, device_name: str | None = None) -> int:
    """Bytes NCCL allocates on each GPU when the profile run connects the tensor-parallel ring
    (0 without tensor parallelism): its channels × one buffer per protocol."""
    if tp < 2:
        return 0
    found = card(device_name) if device_name else None
    channels = found.nccl_channels if found is not None else NVLINK_CHANNELS
    return channels * NCCL_PROTOCOL_BUFFERS


def doubtful_total(gib: float) -> str | None:
    """Why a GPU total someone typed looks like another total than CUDA's — nvidia-smi's (which
    counts reserved memory), a marketing size, MiB — or None when it does not. The figure stays
    the user's; this only says which total vLLM uses."""
    cuda_hint = "; ".join(f"{c.name} {c.cuda_gib:.2f}" for c in CARDS[:3])
    why = None
    if gib >= 1024:
        why = f"{gib:,g} GiB is more than any GPU holds: a total in MiB?"
    elif gib == round(gib) and not any(abs(gib - c.cuda_gib) < 0.01 for c in CARDS):
        why = f"{gib:g} GiB is a round number, as a card's marketing size is"
    else:
        for found in CARDS:
            smi = found.nvidia_smi_mib
            if min(abs(gib - smi / 1024), abs(gib - smi * MIB / 1e9), abs(gib - smi / 1000)) < 0.05:
                why = (f"{gib:g} GiB looks like nvidia-smi's total for the {found.name} "
                       f"({smi:,} MiB), which counts the memory the driver reserves; CUDA "
                       f"reports {found.cuda_gib:.2f} GiB (--gpu {found.name})")  # fmt: skip
                break
    if why is None:
        return None
    return (f"{why}. vLLM multiplies --gpu-memory-utilization by the total CUDA reports: "
            f"nvidia-smi's total less its reserved memory ({cuda_hint} GiB; --gpu NAME knows "
            f"{card_names()}; on the GPU machine itself the total is read through NVML). "
            f"Computed with {gib:g} GiB as given.")  # fmt: skip


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """vLLM's CUDA graph capture sizes (`VllmConfig._set_cudagraph_sizes`)."""
    top = min(max_num_seqs * 2, 512, max_num_batched_tokens)
    sizes = [s for s in (1, 2, 4) if s <= top]
    sizes += list(range(8, min(top + 1, 256), 8))
    sizes += list(range(256, top + 1, 16))
    return sizes


def _allocated(nbytes: int) -> int:
    """What torch's CUDA caching allocator takes for one tensor: above 1 MiB a multiple of
    2 MiB, else of 512 bytes."""
    step = 2 * MIB if nbytes > MIB else 512
    return -(-nbytes // step) * step


def rounding(shape: Shape, dtype_bytes: int, tp: int = 1) -> int:
    """Bytes the allocator adds to the weights of a Llama-style model as vLLM lays them out:
    merged QKV and gate/up projections, the output and down projections, two norms per layer,
    embeddings and head with the vocabulary padded to a multiple of 64."""
    heads, kv_heads = math.ceil(shape.heads / tp), max(1, shape.kv_heads // tp)
    inter = math.ceil(shape.intermediate / tp)
    vocab = -(-shape.vocab // 64) * 64
    h, d, b = shape.hidden, shape.head_dim, dtype_bytes
    layer = [h * (heads + 2 * kv_heads) * d * b, heads * d * h * b, h * 2 * inter * b,
             inter * h * b, h * b, h * b]  # fmt: skip
    tensors = layer * shape.layers + [math.ceil(vocab / tp) * h * b] * 2 + [h * b]
    exact = sum(layer) * shape.layers + 2 * shape.vocab * h * b // tp + h * b
    return sum(_allocated(t) for t in tensors) - exact


def layer_peak(shape: Shape, tokens: int, dtype_bytes: int, tp: int = 1) -> int:
    """Bytes live at the busiest point of one decoder layer for `tokens` tokens (per GPU)."""
    residual = 2 * tokens * shape.hidden
    mlp = 3 * tokens * math.ceil(shape.intermediate / tp)  # gate/up output + activation output
    heads, kv_heads = math.ceil(shape.heads / tp), max(1, shape.kv_heads // tp)
    attention = tokens * shape.head_dim * ((heads + 2 * kv_heads) + heads)
    return dtype_bytes * (residual + max(mlp, attention))


def sampler_peak(shape: Shape, requests: int, dtype_bytes: int) -> int:
    return requests * shape.vocab * (SAMPLER_BYTES_PER_LOGIT + dtype_bytes)


def predict(
    shape: Shape,
    *,
    total_bytes: int,
    utilization: float,
    weight_bytes: int,
    dtype_bytes: int,
    tp: int = 1,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
    cudagraphs: bool = True,
    extra_bytes: int = 0,
    device_name: str | None = None,
    weights_rounded: bool = False,
    persistent_bytes: int = 0,
    non_torch_bytes: int | None = None,
    layer_of: Callable[[int], int] | None = None,
    graph_first_of: Callable[[int], int] | None = None,
) -> GpuMemory:
    """vLLM's available KV memory on one GPU, term by term (see the module docstring).
    `weights_rounded`: `weight_bytes` already holds the allocator's rounding (an MoE or MLA
    model's tensors, `loadgen/architecture.py`); `persistent_bytes`: buffers the profile run
    allocates and keeps (the fused-MoE workspace), beside the busiest layer's tensors;
    `non_torch_bytes`: that term when the model's kernels differ from a dense model's;
    `layer_of`: the busiest layer's bytes for T tokens when the model is not a dense Llama's
    layout (`architecture.layer_peak`), for the profiled step and the CUDA graphs' pool;
    `graph_first_of`: what the first FULL capture of that many tokens holds beyond the pool
    (`architecture.full_graph_buffers`), when vLLM's runner measures its graphs."""
    tokens_default, seqs_default = scheduler_defaults(total_bytes / GIB, device_name)
    tokens = max_num_batched_tokens or tokens_default
    seqs = max_num_seqs or seqs_default
    requested = math.ceil(total_bytes * utilization)
    weights = weight_bytes + (0 if weights_rounded else max(0, rounding(shape, dtype_bytes, tp)))
    if layer_of is None:
        layer_of = partial(layer_peak, shape, dtype_bytes=dtype_bytes, tp=tp)
    layer = layer_of(tokens)
    activation = persistent_bytes + (
        max(layer,  # the forward pass, or the sampler
            sampler_peak(shape, min(seqs, tokens), dtype_bytes)  # beside the pass's output
            + tokens * shape.hidden * dtype_bytes)
        + CUBLAS_WORKSPACE
    )  # fmt: skip
    sizes = capture_sizes(seqs, tokens) if cudagraphs else []
    graphs = 0
    if sizes:
        pool = layer_of(max(sizes))
        if graph_first_of is not None:  # the first FULL capture, if larger, sets the pool
            pool = max(pool, graph_first_of(max(sizes)))
        graphs = pool + GRAPH_FLOOR * (2 * len(sizes) - 2)  # PIECEWISE and FULL, less the firsts
    non_torch = int(NON_TORCH_GIB * GIB) if non_torch_bytes is None else non_torch_bytes
    nccl = nccl_buffers(tp, device_name)
    available = requested - weights - activation - non_torch - nccl - graphs - extra_bytes
    return GpuMemory(
        total=total_bytes,
        requested=requested,
        weights=weights,
        activation_peak=activation,
        non_torch=non_torch,
        nccl=nccl,
        cudagraphs=graphs,
        extra=extra_bytes,
        available=max(available, 0),
        max_num_batched_tokens=tokens,
        max_num_seqs=seqs,
        cudagraph_sizes=len(sizes),
    )
