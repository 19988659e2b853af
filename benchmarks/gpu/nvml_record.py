"""nvml_record.py OUT INTERVAL — NVML samples of every GPU as JSON lines until killed: the raw
readings the collector's GPU sampler turns into metric samples (`collector/gpu.py`, whose
`nvml_rows()` reads them: one row per GPU), recorded on a GPU server so tests without a GPU
replay real values."""

from __future__ import annotations

import json
import signal
import sys
import time

from servescope.collector.gpu import nvml_open, nvml_rows


def main() -> None:
    out, interval = sys.argv[1], float(sys.argv[2])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    nvml_open()
    with open(out, "a") as f:
        while True:
            started = time.monotonic()
            for row in nvml_rows():
                f.write(json.dumps(row) + "\n")
            f.flush()
            time.sleep(max(0.0, interval - (time.monotonic() - started)))


if __name__ == "__main__":
    main()
