"""GPU telemetry: NVML records and dcgm-exporter pages become the same samples (dcgm-exporter's
names and units), the live collector stores them on the server session running then, and the
reports turn them into mean power, utilisation and energy per output token and per request,
with intervals and verdicts in a diff. CI has no GPU: NVML's records and dcgm-exporter's page
come from files recorded on a GPU server (tests/fixtures/gpu/: hand-written until recorded,
see its README); everything past the NVML calls is the code that runs there.
"""

from __future__ import annotations

from datetime import datetime

import pytest

from servescope.collector import gpu
from tests.helpers.gpu_recordings import DCGM, nvml_records


def test_nvml_records_read_as_dcgm_exporter_would_expose_them() -> None:
    first = nvml_records()[len(nvml_records()) // 2]
    samples = gpu.samples_of(first, run_id="vllm-x")
    by = {(s[2], s[3].get("GPU_I_ID")): s for s in samples}
    power = by[(gpu.POWER, None)]
    assert power[1] == gpu.NVML_TARGET and power[4] == "vllm-x"
    assert power[5] == pytest.approx(first["power_mw"] / 1000)  # mW → W
    assert by[(gpu.ENERGY, None)][5] == first["energy_mj"]  # mJ, as DCGM counts
    assert by[(gpu.FB_USED, None)][5] == pytest.approx(first["fb_used_bytes"] / 2**20)  # MiB
    assert power[3]["UUID"] == first["uuid"] and power[3]["gpu"] == str(first["gpu"])
    dcgm = gpu.dcgm_samples(DCGM.read_text(), url="http://h:9400/metrics", ts=datetime(2026, 1, 1))
    # the same names and label keys either way
    assert {s[2] for s in dcgm} <= set(gpu.NAMES) and gpu.ENERGY in {s[2] for s in dcgm}
    assert {"gpu", "UUID"} <= set(dcgm[0][3])
    assert {s[2] for s in samples} <= set(gpu.NAMES)


def test_a_mig_gpu_has_memory_per_instance_and_one_power() -> None:
    record = {"ts": 1795000000.0, "gpu": 0, "uuid": "GPU-a", "power_mw": 300000, "energy_mj": 5,
              "fb_used_bytes": 2**30,
              "mig": [{"gi_id": 1, "uuid": "MIG-1", "fb_used_bytes": 2**29},
                      {"gi_id": 2, "uuid": "MIG-2", "fb_used_bytes": 2**28}]}  # fmt: skip
    samples = gpu.samples_of(record)
    fb = sorted((s[3].get("GPU_I_ID", ""), s[5]) for s in samples if s[2] == gpu.FB_USED)
    assert fb == [("", 1024.0), ("1", 512.0), ("2", 256.0)]
    assert [s[5] for s in samples if s[2] == gpu.POWER] == [300.0]


def test_cuda_visible_devices_picks_the_gpus_read() -> None:
    assert gpu.visible_devices(None) is None and gpu.visible_devices("") is None
    pick = gpu.visible_devices("1,GPU-b")
    assert pick is not None and pick(1, "GPU-x") and pick(0, "GPU-b") and not pick(0, "GPU-a")
    assert gpu.visible_devices("MIG-1") is None  # an instance's power is its GPU's


# -- reports ------------------------------------------------------------------------------------
