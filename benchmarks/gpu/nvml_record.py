"""nvml_record.py OUT INTERVAL — NVML samples of every GPU as JSON lines until killed: the raw
readings the collector's GPU sampler turns into metric samples, recorded on a GPU server so tests
without a GPU replay real values."""

from __future__ import annotations

import json
import signal
import sys
import time

import pynvml


def main() -> None:
    out, interval = sys.argv[1], float(sys.argv[2])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    with open(out, "a") as f:
        while True:
            for i, h in enumerate(handles):
                util = pynvml.nvmlDeviceGetUtilizationRates(h)
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                row = {
                    "ts": time.time(), "gpu": i, "uuid": str(pynvml.nvmlDeviceGetUUID(h)),
                    "name": str(pynvml.nvmlDeviceGetName(h)),
                    "power_mw": pynvml.nvmlDeviceGetPowerUsage(h),
                    "energy_mj": pynvml.nvmlDeviceGetTotalEnergyConsumption(h),
                    "fb_used_bytes": mem.used, "fb_total_bytes": mem.total,
                    "gpu_util_pct": util.gpu, "mem_util_pct": util.memory,
                    "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                }  # fmt: skip
                f.write(json.dumps(row) + "\n")
            f.flush()
            time.sleep(interval)


if __name__ == "__main__":
    main()
