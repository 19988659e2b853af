"""nvml_gpus.py memory OUT | nvml_gpus.py record OUT INTERVAL — what a GPU server's cards say
about themselves, through NVML alone (nvidia-ml-py, on the GPU server's image), so it runs before
servescope is installed there.

`memory` writes one JSON object: per GPU (index and UUID) NVML's total, reserved, used and free
framebuffer bytes (nvmlMemory_v2: the total less the reserved is what CUDA reports as the card's
memory, the total vLLM's `--gpu-memory-utilization` applies to) and, when torch is there, what
CUDA itself reports (`mem_get_info`, `total_memory`), so the two can be compared.

`record` appends one JSON line per GPU per interval until killed: the fields of the collector's
NVML rows (`collector/gpu.py`, `nvml_rows()`: power, cumulative energy, framebuffer, utilisation,
SM clock) keyed by index and UUID, plus the reserved bytes and the compute processes on that GPU
with their memory (`nvmlDeviceGetComputeRunningProcesses`): what attributes a GPU's energy to the
server whose processes hold it."""

from __future__ import annotations

import json
import signal
import sys
import time
from typing import Any

import pynvml


def _read(call: Any, *args: Any) -> Any:
    """One NVML call, None where the GPU does not support it (a recording keeps going)."""
    try:
        return call(*args)
    except pynvml.NVMLError:
        return None


def _text(value: Any) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def memory(handle: Any) -> dict[str, int]:
    """Framebuffer bytes by nvmlMemory_v2 (with `reserved`), or v1 where v2 is refused."""
    info = _read(pynvml.nvmlDeviceGetMemoryInfo, handle, pynvml.nvmlMemory_v2)
    if info is None:
        info = _read(pynvml.nvmlDeviceGetMemoryInfo, handle)
    if info is None:
        return {}
    out = {"fb_total_bytes": info.total, "fb_used_bytes": info.used, "fb_free_bytes": info.free}
    reserved = getattr(info, "reserved", None)
    if reserved is not None:
        out["fb_reserved_bytes"] = reserved
    return out


def processes(handle: Any) -> list[dict[str, int | None]]:
    """The compute processes on one GPU and the memory each holds there."""
    found = _read(pynvml.nvmlDeviceGetComputeRunningProcesses, handle) or []
    return [{"pid": p.pid, "used_bytes": p.usedGpuMemory} for p in found]


def row(index: int) -> dict[str, Any]:
    """One reading of GPU `index`, fields as the collector's NVML rows name them."""
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    util = _read(pynvml.nvmlDeviceGetUtilizationRates, handle)
    out: dict[str, Any] = {
        "ts": time.time(),
        "gpu": index,
        "uuid": _text(_read(pynvml.nvmlDeviceGetUUID, handle)),
        "name": _text(_read(pynvml.nvmlDeviceGetName, handle)),
        "power_mw": _read(pynvml.nvmlDeviceGetPowerUsage, handle),
        "energy_mj": _read(pynvml.nvmlDeviceGetTotalEnergyConsumption, handle),
        **memory(handle),
        "gpu_util_pct": util.gpu if util is not None else None,
        "mem_util_pct": util.memory if util is not None else None,
        "sm_clock_mhz": _read(pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_SM),
        "processes": processes(handle),
    }
    return {k: v for k, v in out.items() if v is not None}


def cuda_view() -> list[dict[str, Any]]:
    """What CUDA reports per device (torch), or nothing where torch or a GPU is missing."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        props = torch.cuda.get_device_properties(i)
        out.append({"device": i, "name": props.name, "total_memory": props.total_memory,
                    "mem_get_info_free": free, "mem_get_info_total": total,
                    "total_gib": round(total / 2**30, 3)})  # fmt: skip
    return out


def main() -> int:
    usage = "usage: nvml_gpus.py memory OUT | nvml_gpus.py record OUT INTERVAL"
    if len(sys.argv) < 3 or sys.argv[1] not in ("memory", "record"):
        print(usage, file=sys.stderr)
        return 2
    pynvml.nvmlInit()
    count = pynvml.nvmlDeviceGetCount()
    if sys.argv[1] == "memory":
        gpus = [row(i) for i in range(count)]
        info = {"driver": _text(_read(pynvml.nvmlSystemGetDriverVersion)), "gpus": gpus,
                "cuda": cuda_view()}  # fmt: skip
        with open(sys.argv[2], "w") as f:
            json.dump(info, f, indent=2)
        return 0
    interval = float(sys.argv[3]) if len(sys.argv) > 3 else 1.0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with open(sys.argv[2], "a") as f:
        while True:
            started = time.monotonic()
            for i in range(count):
                f.write(json.dumps(row(i)) + "\n")
            f.flush()
            time.sleep(max(0.0, interval - (time.monotonic() - started)))


if __name__ == "__main__":
    sys.exit(main())
