"""`servescope capacity MODEL`: the capacity worksheet, filled from the model's config."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import yaml

from servescope.commands.common import console, open_store, store_command
from servescope.loadgen import gpu_memory
from servescope.loadgen.architecture import ArchitectureSummary
from servescope.loadgen.capacity import (
    GIB,
    CapacityError,
    Settings,
    Traffic,
    compute,
    cost_per_1k_tokens,
    load_shape,
    run_traffic,
    worksheet,
)

DESCRIPTION = (
    "Fill the capacity worksheet for a model: weight bytes, KV bytes per token (per GPU "
    "with tensor parallelism), KV blocks and tokens that fit, the largest concurrency at "
    "max_model_len (as vLLM states it at start-up) and at the p50/p95 request shape, whether "
    "max_model_len fits at all, and the cost per 1K tokens at a stored run's measured "
    "throughput. The architecture is read from config.json — dense, mixture-of-experts "
    "(routed and shared experts, dense layers), MLA, sliding-window layers (vLLM's hybrid KV "
    "cache groups) — and the weights from the checkpoint's safetensors headers when the "
    "folder has them; a model_type it does not model (Mamba, linear attention, unknown) is "
    "refused. The KV space is --kv-cache-gib (vLLM-CPU's VLLM_CPU_KVCACHE_SPACE) or one "
    "GPU's memory × --gpu-memory-utilization less what vLLM subtracts at start-up (weights, "
    "the activation peak of a --max-num-batched-tokens step, non-torch memory, CUDA graphs; "
    "docs/design.md 'Capacity on a GPU') and --overhead-gib: vLLM's 'Available KV cache "
    "memory' and 'GPU KV cache size', per GPU under tensor parallelism and per engine under "
    "data parallelism. The GPU's memory is the total CUDA reports, which is nvidia-smi's total "
    "less the memory the driver reserves: --gpu NAME knows it for common cards, on a machine "
    "with a GPU it is read through NVML, and --gpu-memory-gib takes it as a number. "
    "Prints Markdown (--json or --yaml for scripts; --out DIR writes capacity.yaml and "
    "capacity.md). Exit codes: 0 done (a GPU total that looks like nvidia-smi's or a "
    "marketing size is a warning on stderr, as is what the worksheet did not model), 2 bad "
    "input (unreadable config, unknown dtype, unknown card, unknown run, a model_type it "
    "does not model)."
)


# A declarative table (argparse set-up, one statement per option): longer than 80 lines by
# design, as the house rule allows.
def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("capacity", help="KV-cache math and the capacity worksheet",
                       description=DESCRIPTION)  # fmt: skip
    p.add_argument("model", type=Path, metavar="MODEL", help="a model folder or its config.json")
    p.add_argument("--dtype", default="auto", help="weights dtype (default: the config's)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (= --dtype), fp8, …")
    p.add_argument("--max-model-len", type=int, help="default: max_position_embeddings")
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="TP",
        help="GPUs one engine's model is split over; numbers are per GPU",
    )
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="DP",
        help="engines, each a whole copy of the model on its own TP GPUs; numbers "
        "are per engine, with the totals of all engines beside them",
    )
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="vLLM's flag: a mixture-of-experts model's routed experts spread whole over the "
        "TP × DP GPUs (per-GPU weights), the rest split over TP",
    )
    space = p.add_mutually_exclusive_group()
    space.add_argument("--kv-cache-gib", type=float, help="KV space per GPU/node in GiB")
    space.add_argument(
        "--gpu",
        metavar="NAME",
        help="the card, whose total as CUDA reports it is known: "
        + gpu_memory.card_names()
        + " (aliases such as H100-NVL, A100-SXM4-80GB too)",
    )
    space.add_argument(
        "--gpu-memory-gib",
        type=float,
        metavar="GIB",
        help="one GPU's total memory as CUDA reports it (torch.cuda.mem_get_info()[1] / 2**30), "
        "which is nvidia-smi's total less its reserved memory (nvidia-smi -q: FB Memory Usage, "
        "Total − Reserved): 79.18 on an H100 80GB, not nvidia-smi's 81,559 MiB nor 80. Default: "
        "--gpu's, else NVML's on a machine with a GPU",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument(
        "--overhead-gib",
        type=float,
        default=0.0,
        help="memory per GPU held by anything vLLM does not profile (another process, a "
        "second replica's share…); default 0",
    )
    p.add_argument("--max-num-batched-tokens", type=int, metavar="B",
                   help="the profiled step (default: vLLM's, 8192 on GPUs of 70 GiB or more, "
                   "else 2048)")  # fmt: skip
    p.add_argument(
        "--max-num-seqs",
        type=int,
        metavar="S",
        help="requests per step (default: vLLM's, 1024 or 256 as above)",
    )
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="the server's device, which sets the default block size (16 on CUDA, 128 on "
        "vLLM-CPU); auto: cuda with --gpu-memory-gib, else cpu",
    )
    p.add_argument("--block-size", type=int, help="tokens per KV block (default: the device's)")
    for q in ("p50", "p95"):
        for kind in ("prompt", "output"):
            p.add_argument(f"--{q}-{kind}-tokens", type=float, metavar="N")
    p.add_argument(
        "--from-run", metavar="RUN", help="traffic, TTFT/ITL p95 and throughput from a stored run"
    )
    p.add_argument("--ttft-p95-ms", type=float, help="target")
    p.add_argument("--itl-p95-ms", type=float, help="target")
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        help="the worksheet's tuning entry (no effect on the arithmetic)",
    )
    p.add_argument("--speculative-config", help="the worksheet's tuning entry, as JSON text")
    p.add_argument("--gpu-hour-usd", type=float, help="price of one GPU hour, for cost per 1K")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print everything as JSON")
    out.add_argument("--yaml", action="store_true", help="print the filled worksheet as YAML")
    p.add_argument("--out", type=Path, metavar="DIR", help="also write DIR/capacity.{yaml,md}")
    store_command(p, run)


def _positive(args: argparse.Namespace) -> str | None:
    for name in ("max_model_len", "tensor_parallel_size", "data_parallel_size", "block_size",
                 "kv_cache_gib", "gpu_memory_gib", "max_num_batched_tokens",
                 "max_num_seqs"):  # fmt: skip
        value = getattr(args, name)
        if value is not None and value <= 0:
            return f"--{name.replace('_', '-')} must be positive, got {value}"
    if not 0 < args.gpu_memory_utilization <= 1:
        return "--gpu-memory-utilization must be in (0, 1]"
    return None


def _gpu_memory(args: argparse.Namespace) -> tuple[float | None, str | None, str | None]:
    """One GPU's total as CUDA reports it, the card's name and where the figure comes from:
    `--gpu`'s table, `--gpu-memory-gib` as given (with a warning when it looks like another
    total), else NVML on a machine with a GPU; (None, None, None) for a CPU server or KV space
    given as such. An unknown card is a `CapacityError`."""
    if args.gpu is not None:
        found = gpu_memory.card(args.gpu)
        if found is None:
            raise CapacityError(f"unknown card {args.gpu!r}; known: {gpu_memory.card_names()} "
                                "(else give --gpu-memory-gib)")  # fmt: skip
        source = f"{found.name}: {gpu_memory.card_source(found)}"
        return found.cuda_gib, found.name, source
    if args.gpu_memory_gib is not None:
        if doubt := gpu_memory.doubtful_total(args.gpu_memory_gib):
            console.print(f"warning: --gpu-memory-gib {doubt}", style="yellow")
        return args.gpu_memory_gib, None, "--gpu-memory-gib, as given"
    if args.kv_cache_gib is None and args.device != "cpu" and (
            found_here := gpu_memory.nvml_cuda_total()):  # fmt: skip
        total, name = found_here
        return total / GIB, name, f"NVML: {name}, total less reserved"
    return None, None, None


def run(args: argparse.Namespace) -> int:
    if problem := _positive(args):
        console.print(problem, style="red")
        return 2
    try:
        gpu_gib, gpu_name, gpu_source = _gpu_memory(args)
    except CapacityError as exc:
        console.print(str(exc), style="red")
        return 2
    # The options are named as Settings' fields (vLLM's flags); the GPU's memory was resolved.
    given = {f.name: getattr(args, f.name) for f in fields(Settings) if hasattr(args, f.name)}
    resolved = {"gpu_memory_gib": gpu_gib, "gpu_name": gpu_name, "gpu_memory_source": gpu_source}
    settings = Settings(**{**given, **resolved})
    traffic = Traffic(args.p50_prompt_tokens, args.p95_prompt_tokens,
                      args.p50_output_tokens, args.p95_output_tokens)  # fmt: skip
    measured: dict[str, Any] | None = None
    try:
        shape = load_shape(args.model)
        if args.from_run:
            stored = _from_run(args)
            if stored is None:
                return 2
            traffic = replace(stored.pop("traffic"), **{
                k: v for k, v in vars(traffic).items() if v is not None})  # fmt: skip
            measured = stored
        result = compute(shape, settings, traffic)
    except CapacityError as exc:
        console.print(str(exc), style="red")
        return 2
    if measured is not None and args.gpu_hour_usd is not None:
        measured["cost_per_1k_tokens"] = cost_per_1k_tokens(
            args.gpu_hour_usd, result["gpus"], measured["tokens_per_s"]
        )
    targets = {"ttft_p95": args.ttft_p95_ms, "itl_p95": args.itl_p95_ms,
               "cost_per_1k_tokens": (measured or {}).get("cost_per_1k_tokens")}  # fmt: skip
    tuning = {"enable_prefix_caching": args.enable_prefix_caching,
              "speculative_config": args.speculative_config}  # fmt: skip
    sheet = worksheet(result, traffic, targets, measured, tuning)
    result["worksheet"] = sheet
    text = markdown(result, sheet)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "capacity.yaml").write_text(yaml.safe_dump(sheet, sort_keys=False))
        (args.out / "capacity.md").write_text(text)
    for warning in result["warnings"]:
        console.print(f"warning: {warning}", style="yellow")
    if args.json:
        print(json.dumps(result, indent=2))
    elif args.yaml:
        print(yaml.safe_dump(sheet, sort_keys=False), end="")
    else:
        print(text, end="")
    return 0


def _from_run(args: argparse.Namespace) -> dict[str, Any] | None:
    from servescope.reports import UnknownRun
    from servescope.reports.summary import require_run

    store = open_store(args)
    try:
        with store.read() as con:
            require_run(con, args.from_run)
    except UnknownRun as exc:
        console.print(str(exc), style="red")
        return None
    return run_traffic(store, args.from_run)


def _n(value: Any, digits: int = 0) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _x(value: float | None) -> str:
    """A concurrency multiplier; a missing one is "n/a" alone, never "n/ax"."""
    return "n/a" if value is None else f"{value:,.2f}x"


def _bytes(value: int | None) -> str:
    return "n/a" if value is None else f"{value:,} B ({value / 2**30:,.2f} GiB)"


def _gpu_terms(memory: dict[str, Any] | None, source: str | None) -> list[str]:
    """The terms of the GPU memory model, one row each (GiB)."""
    if not memory:
        return []
    return [
        f"| GPU memory (as CUDA reports it) | {memory['total']} GiB: {source} |",
        f"| GPU: {memory['total']} GiB × utilization = {memory['requested']} GiB − weights "
        f"{memory['weights']} − activation peak {memory['activation_peak']} (a "
        f"{memory['max_num_batched_tokens']:,}-token step, {memory['max_num_seqs']:,} sequences) "
        f"− non-torch {memory['non_torch']} − NCCL buffers {memory['nccl']} "
        f"− CUDA graphs {memory['cudagraphs']} "
        f"({memory['cudagraph_sizes']} sizes) − overhead {memory['extra']} | "
        f"available KV cache memory {memory['available']} GiB |",
    ]


def _architecture_rows(arch: ArchitectureSummary, expert_parallel: bool) -> list[str]:
    """The attention kind and the experts, as the worksheet sized them."""
    rows = [f"| architecture | {arch['family']}: {arch['attention']}; "
            f"{arch['kv_cache_groups']} KV cache group(s) of {arch['kv_cache_group_size']} "
            "layers |"]  # fmt: skip
    if moe := arch["moe"]:
        shared = (
            f", shared {moe['shared_intermediate']:,} wide" if moe["shared_intermediate"] else ""
        )
        dense = f", dense layers {list(moe['dense_layers'])}" if moe["dense_layers"] else ""  # type: ignore[call-overload]
        spread = "; expert parallel" if expert_parallel else ""
        rows.append(f"| experts | {moe['experts']} routed, {moe['top_k']} a token, "
                    f"{moe['intermediate']:,} wide{shared}{dense}{spread} |")  # fmt: skip
    if mla := arch["mla"]:
        rows.append(f"| MLA | latent {mla['kv_lora_rank']} + rope {mla['qk_rope_head_dim']} "
                    "values a token and layer, whole on every GPU |")  # fmt: skip
    return rows


def markdown(result: dict[str, Any], sheet: dict[str, Any]) -> str:
    """The worksheet for people: what was read, what it implies."""
    m, s = result["model"], result["settings"]
    # vLLM-CPU splits a model over CPU workers, not GPUs: its memory is the host's
    unit = "CPU worker" if s.get("device") == "cpu" else "GPU"
    lines = [
        f"# Capacity worksheet: {m['name']}",
        "",
        "| | |",
        "|---|---|",
        f"| parameters | {_n(m['parameters'])} (from {m['parameters_basis']}) |",
        *_architecture_rows(result["architecture"], m["expert_parallel"]),
        f"| layers / attention heads / KV heads / head dim | {m['layers']} / "
        f"{m['attention_heads']} / {m['kv_heads']} / {m['head_dim']} |",
        f"| dtype / KV-cache dtype | {s['dtype']} / {s['kv_cache_dtype']} |",
        f"| tensor parallel size | {s['tensor_parallel_size']} "
        f"({m['kv_heads_per_gpu']} KV heads per {unit}) |",
        f"| data parallel size | {s['data_parallel_size']} (engines; {result['gpus']} "
        f"{unit}s in all) |",
        f"| weights | {_bytes(m['weight_bytes'])}; per {unit} "
        f"{_bytes(m['weight_bytes_per_gpu'])} |",
        f"| KV bytes per token (per {unit}) | {_n(result['kv_bytes_per_token'])} |",
        f"| KV bytes per sequence at max_model_len {_n(s['max_model_len'])} | "
        f"{_bytes(result['kv_bytes_per_sequence_at_max_model_len'])} |",
        f"| KV space | {_bytes(result['kv_cache_bytes'])}: {result['kv_cache_bytes_basis']} |",
        *_gpu_terms(result.get("gpu_memory"), s.get("gpu_memory_source")),
        f"| KV blocks ({s['block_size']} tokens) | {_n(result['kv_blocks'])} |",
        f"| KV tokens | {_n(result['kv_tokens'])} |",
        f"| max concurrency at {_n(s['max_model_len'])} tokens per request | "
        f"{_x(result['max_concurrency'])} |",
        f"| max_model_len fits | {_n(result['max_model_len_fits'])} |",
        *(f"| warning | {w} |" for w in result["warnings"]),
    ]
    if s["data_parallel_size"] > 1:
        lines.append(
            f"| all {s['data_parallel_size']} engines | {_n(result['kv_tokens_all_engines'])} KV "
            f"tokens, {_x(result['max_concurrency_all_engines'])} at max_model_len |"
        )
    for q, at in result["concurrency_at"].items():
        lines.append(
            f"| max concurrency at the {q} request ({_n(at['tokens_per_request'])} tokens) | "
            f"{_x(at['max_concurrency'])} |"
        )
    measured = sheet.get("measured")
    if measured:
        lines += [
            f"| measured in `{measured['run_id']}` | TTFT p95 {_n(measured['ttft_p95_ms'], 1)} ms, "
            f"ITL p95 {_n(measured['itl_p95_ms'], 1)} ms, {_n(measured['tokens_per_s'], 1)} "
            f"tokens/s |",
            f"| cost per 1K tokens | {_n(measured.get('cost_per_1k_tokens'), 5)} USD |",
        ]
    lines += ["", "```yaml", yaml.safe_dump(sheet, sort_keys=False).rstrip(), "```", ""]
    return "\n".join(lines)
