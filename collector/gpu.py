"""GPU telemetry for the sidecar: NVML read in-process, or a dcgm-exporter `/metrics` target,
stored as `metric_samples` under dcgm-exporter's names so the two are one thing to the reports
and the dashboards.

The NVML boundary is `nvml_rows()` and nothing else: one call per field, returning plain rows
(those `benchmarks/gpu/nvml_record.py` records on a GPU server), so every step after it is
tested on records recorded from a real GPU server. NVML has no per-instance power or energy on
MIG: those stay the physical GPU's; memory used is read per MIG instance too (label
`GPU_I_ID`, as dcgm-exporter does).
"""

from __future__ import annotations

import logging
import os
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from servescope.wire.exposition import Sample, parse_exposition

log = logging.getLogger("servescope.collector")

# dcgm-exporter's field names, with NVML's units converted to theirs.
POWER = "DCGM_FI_DEV_POWER_USAGE"  # W
ENERGY = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"  # mJ since the driver loaded
FB_USED = "DCGM_FI_DEV_FB_USED"  # MiB
GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"  # %
MEM_COPY_UTIL = "DCGM_FI_DEV_MEM_COPY_UTIL"  # %
SM_CLOCK = "DCGM_FI_DEV_SM_CLOCK"  # MHz
NAMES = (POWER, ENERGY, FB_USED, GPU_UTIL, MEM_COPY_UTIL, SM_CLOCK)
NVML_TARGET = "nvml"
MIB = 1 << 20


class NoGpu(Exception):
    """NVML cannot be loaded or sees no GPU: the reason, in one line."""


def nvml_open() -> int:
    """Initialise NVML; the number of GPUs it sees. Raises NoGpu with the reason."""
    try:
        import pynvml
    except ImportError:
        raise NoGpu("nvidia-ml-py is not installed") from None
    try:
        pynvml.nvmlInit()
        count = int(pynvml.nvmlDeviceGetCount())
    except pynvml.NVMLError as exc:
        raise NoGpu(f"NVML: {exc}") from None
    if count == 0:
        raise NoGpu("NVML sees no GPU")
    return count


def nvml_rows() -> list[dict[str, Any]]:
    """One reading of every GPU NVML sees (those of `CUDA_VISIBLE_DEVICES` when set), one plain
    row per GPU — the rows `benchmarks/gpu/nvml_record.py` records on a GPU server — with its
    MIG instances' memory under `mig` and the processes computing on it under `processes`
    (`pid`, `used_bytes`: what the collector matches to a server's processes). A field the GPU
    does not support is left out. The only code here that touches a GPU."""
    import pynvml

    def read(call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except pynvml.NVMLError:
            return None

    now = time.time()
    rows = []
    wanted = visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"))
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        uuid = _text(read(pynvml.nvmlDeviceGetUUID, handle))
        if wanted is not None and not wanted(index, uuid):
            continue
        util = read(pynvml.nvmlDeviceGetUtilizationRates, handle)
        memory = read(pynvml.nvmlDeviceGetMemoryInfo, handle)
        row: dict[str, Any] = {
            "ts": now,
            "gpu": index,
            "uuid": uuid,
            "name": _text(read(pynvml.nvmlDeviceGetName, handle)),
            "power_mw": read(pynvml.nvmlDeviceGetPowerUsage, handle),
            "energy_mj": read(pynvml.nvmlDeviceGetTotalEnergyConsumption, handle),
            "fb_used_bytes": memory.used if memory is not None else None,
            "fb_total_bytes": memory.total if memory is not None else None,
            "gpu_util_pct": util.gpu if util is not None else None,
            "mem_util_pct": util.memory if util is not None else None,
            "sm_clock_mhz": read(pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_SM),
            "processes": _processes(read(pynvml.nvmlDeviceGetComputeRunningProcesses, handle)),
        }
        mode = read(pynvml.nvmlDeviceGetMigMode, handle)
        if mode is not None and mode[0] == pynvml.NVML_DEVICE_MIG_ENABLE:
            row["mig"] = []
            for slot in range(read(pynvml.nvmlDeviceGetMaxMigDeviceCount, handle) or 0):
                mig = read(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, slot)
                if mig is None:
                    continue
                used = read(pynvml.nvmlDeviceGetMemoryInfo, mig)
                row["mig"].append({
                    "gi_id": read(pynvml.nvmlDeviceGetGpuInstanceId, mig),
                    "uuid": _text(read(pynvml.nvmlDeviceGetUUID, mig)),
                    "fb_used_bytes": used.used if used is not None else None,
                })  # fmt: skip
        rows.append({k: v for k, v in row.items() if v is not None})
    return rows


def _processes(found: Any) -> list[dict[str, Any]] | None:
    """NVML's compute processes on a GPU as plain rows (`pid`, `used_bytes` when NVML knows it);
    None when NVML cannot list them, which is not the same as a GPU nobody uses (`[]`)."""
    if found is None:
        return None
    rows = []
    for proc in found:
        row: dict[str, Any] = {"pid": int(proc.pid)}
        if getattr(proc, "usedGpuMemory", None) is not None:
            row["used_bytes"] = int(proc.usedGpuMemory)
        rows.append(row)
    return rows


def visible_devices(value: str | None) -> Callable[[int, str | None], bool] | None:
    """Which GPUs a `CUDA_VISIBLE_DEVICES` value names (indices or `GPU-…` UUIDs), as a test of
    (index, UUID); None when it names none in particular (unset, or MIG instances, whose
    power and energy are their GPU's anyway)."""
    if not value or not value.strip():
        return None
    names = [v.strip() for v in value.split(",") if v.strip()]
    if any(n.startswith("MIG-") for n in names):
        return None
    return lambda index, uuid: str(index) in names or (uuid is not None and uuid in names)


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


def samples_of(row: dict[str, Any], run_id: str | None = None) -> list[Sample]:
    """One GPU's NVML row as dcgm-exporter would have exposed it: (ts, target, name, labels,
    run_id, value) rows, labels `gpu`, `UUID`, `modelName` (and `GPU_I_ID` per MIG instance)."""
    ts = datetime.fromtimestamp(float(row["ts"]), UTC).replace(tzinfo=None)
    labels = {"gpu": str(row.get("gpu", "")), "UUID": str(row.get("uuid", ""))}
    if row.get("name"):
        labels["modelName"] = str(row["name"])
    values = {
        POWER: _scaled(row.get("power_mw"), 1e-3),
        ENERGY: _scaled(row.get("energy_mj"), 1.0),
        FB_USED: _scaled(row.get("fb_used_bytes"), 1 / MIB),
        GPU_UTIL: _scaled(row.get("gpu_util_pct"), 1.0),
        MEM_COPY_UTIL: _scaled(row.get("mem_util_pct"), 1.0),
        SM_CLOCK: _scaled(row.get("sm_clock_mhz"), 1.0),
    }
    out: list[Sample] = [
        (ts, NVML_TARGET, name, labels, run_id, v) for name, v in values.items() if v is not None
    ]
    for mig in row.get("mig") or []:
        used = _scaled(mig.get("fb_used_bytes"), 1 / MIB)
        if used is not None:
            mig_labels = {**labels, "GPU_I_ID": str(mig.get("gi_id", ""))}
            out.append((ts, NVML_TARGET, FB_USED, mig_labels, run_id, used))
    return out


def _scaled(value: Any, factor: float) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) * factor


def dcgm_samples(text: str, *, url: str, ts: datetime, run_id: str | None = None) -> list[Sample]:
    """The GPU samples of a dcgm-exporter `/metrics` page (its own names and labels; the
    other families it exports are left out). Raises ValueError on text that is not
    exposition format. The client library's parser names a counter's sample `…_total`; the
    energy counter keeps dcgm-exporter's own name, as Prometheus stores it."""
    out: list[Sample] = []
    for ts_, target, name, labels, run, value in parse_exposition(
        text, target=url, ts=ts, run_id=run_id
    ):
        name = name if name in NAMES else name.removesuffix("_total")
        if name in NAMES:
            out.append((ts_, target, name, labels, run, value))
    return out


@dataclass
class GpuSource:
    """Where the collector's GPU samples come from: `nvml` (this host's GPUs) or a
    dcgm-exporter URL. `read()` never raises: a failed read is logged and gives nothing."""

    url: str | None = None  # a dcgm-exporter /metrics URL; None = NVML
    timeout: float = 5.0

    @property
    def name(self) -> str:
        return self.url or NVML_TARGET

    def read(self) -> list[Sample]:
        try:
            if self.url is None:
                return [s for row in nvml_rows() for s in samples_of(row)]
            with urllib.request.urlopen(self.url, timeout=self.timeout) as resp:
                text = resp.read().decode("utf-8", "replace")
            return dcgm_samples(text, url=self.url, ts=datetime.now(UTC).replace(tzinfo=None))
        except Exception as exc:  # a GPU read must never stop the collector
            log.warning("GPU telemetry from %s failed: %s", self.name, exc)
            return []


def open_gpu_source(mode: str, dcgm_url: str | None) -> tuple[GpuSource | None, str]:
    """The GPU source `collect` uses and the one line its log says about it. `mode`: `auto`
    (NVML when it finds a GPU), `on` (NVML must work), `off`; a dcgm-exporter URL wins."""
    if dcgm_url:
        return GpuSource(url=dcgm_url), f"GPU telemetry: scraping dcgm-exporter at {dcgm_url}"
    if mode == "off":
        return None, "GPU telemetry: off"
    try:
        count = nvml_open()
    except NoGpu as exc:
        if mode == "on":
            raise
        return None, f"GPU telemetry: no GPU ({exc})"
    return GpuSource(), f"GPU telemetry: NVML, {count} GPU(s)"
