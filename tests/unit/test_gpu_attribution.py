"""Whose GPU readings are they: each GPU's samples go to the server whose processes compute on
it (else whose CUDA_VISIBLE_DEVICES names it), so two servers on two GPUs each get their own
energy, a tensor-parallel server gets both of its GPUs, and a GPU two servers (or a stranger)
use is no one server's. Readings are NVML rows recorded on a GPU server (tests/fixtures/gpu/),
given a second GPU where the recording has one; dcgm-exporter's recorded page is filtered by
GPU index and UUID.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from servescope.collector import gpu

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gpu"
UUID_1 = "GPU-00000000-0000-0000-0000-000000000001"


def _two_gpus(pids0: list[int] | None, pids1: list[int] | None) -> list[gpu.Reading]:
    """One recorded NVML row of GPU 0 and the same row as GPU 1, with these processes on
    each (None: NVML could not list them)."""
    rows = [json.loads(x) for x in (FIXTURES / "nvml-samples.jsonl").read_text().splitlines()]
    row = rows[len(rows) // 2]
    first: dict[str, Any] = {**row}
    second: dict[str, Any] = {**row, "gpu": 1, "uuid": UUID_1}
    for r, pids in ((first, pids0), (second, pids1)):
        if pids is not None:
            r["processes"] = [{"pid": p, "used_bytes": 2**30} for p in pids]
    return gpu.readings_of_rows([first, second])


def _server(run: str, pids: tuple[int, ...] = (), visible: str | None = None) -> gpu.ServerGpus:
    return gpu.ServerGpus(run, f"http://127.0.0.1:{8000 + len(run)}", frozenset(pids), visible)


def test_two_servers_on_two_gpus_each_get_their_own() -> None:
    readings = _two_gpus([101], [202])
    a, b = _server("a", (100, 101)), _server("b", (200, 202))  # API server + engine core
    assert gpu.owners(readings, [a, b]) == ["a", "b"]


def test_a_tensor_parallel_server_gets_both_gpus() -> None:
    readings = _two_gpus([11], [12])  # one worker a GPU, children of the API server 10
    assert gpu.owners(readings, [_server("tp", (10, 11, 12))]) == ["tp", "tp"]


def test_a_gpu_two_servers_use_is_shared_and_one_a_stranger_uses_too() -> None:
    readings = _two_gpus([101, 202], [202, 999])  # 999: a process of no server here
    a, b = _server("a", (101,)), _server("b", (202,))
    assert gpu.owners(readings, [a, b]) == [gpu.SHARED, gpu.SHARED]


def test_a_gpu_no_server_here_uses_is_dropped() -> None:
    # one sidecar per replica: this collector knows replica a; GPU 1 is the other replica's
    readings = _two_gpus([101], [202])
    assert gpu.owners(readings, [_server("a", (100, 101))]) == ["a", None]


def test_without_processes_the_servers_cuda_visible_devices_places_it() -> None:
    readings = _two_gpus(None, None)  # NVML lists no process (another PID namespace)
    a = _server("a", (100,), visible="0")
    b = _server("b", (200,), visible=UUID_1)
    assert gpu.owners(readings, [a, b]) == ["a", "b"]
    readings = _two_gpus([5000], [6000])  # pids of the host's namespace: none match
    assert gpu.owners(readings, [a, b]) == ["a", "b"]  # not shared: they match no one here


def test_a_server_not_placed_keeps_one_server_a_host() -> None:
    readings = _two_gpus(None, None)
    assert gpu.owners(readings, [_server("a")]) == ["a", "a"]  # as before servers were placed
    assert gpu.owners(readings, [_server("a"), _server("bb")]) == [gpu.SHARED, gpu.SHARED]
    assert gpu.owners(readings, []) == [gpu.SHARED, gpu.SHARED]  # no server: kept, by time


def test_gpu_filter_names_gpus_by_index_or_uuid() -> None:
    readings = _two_gpus(None, None)
    by_index, by_uuid = gpu.gpu_filter("1"), gpu.gpu_filter(f"{readings[0].uuid}, 7")
    assert [by_index(r.index, r.uuid) for r in readings] == [False, True]
    assert [by_uuid(r.index, r.uuid) for r in readings] == [True, False]


def test_a_dcgm_page_is_read_per_gpu_and_filtered() -> None:
    page = (FIXTURES / "dcgm-exporter.txt").read_text()
    second = page.replace('gpu="0"', 'gpu="1"').replace(
        'UUID="GPU-5d9c2b1e-7f3a-4c1b-9e2d-0a1b2c3d4e5f"', f'UUID="{UUID_1}"'
    )
    body = [line for line in second.splitlines() if not line.startswith("#")]
    samples = gpu.dcgm_samples(
        page + "\n".join(body) + "\n", url="http://h:9400/metrics", ts=datetime(2026, 1, 1)
    )
    readings = gpu.readings_of_samples(samples)
    assert sorted((r.index, r.uuid) for r in readings) == [
        ("0", "GPU-5d9c2b1e-7f3a-4c1b-9e2d-0a1b2c3d4e5f"), ("1", UUID_1)
    ]  # fmt: skip
    assert all(r.processes is None for r in readings)
    assert sum(len(r.samples) for r in readings) == len(samples)
    assert {s[3]["gpu"] for r in readings if r.index == "1" for s in r.samples} == {"1"}


def test_the_source_reads_only_the_gpus_named() -> None:
    rows = _two_gpus(None, None)
    recorded = [{"ts": 1795610200.0, "gpu": r.index, "uuid": r.uuid, "power_mw": 300000}
                for r in rows]  # fmt: skip
    source = gpu.GpuSource(nvml=lambda: recorded, only=gpu.gpu_filter("1"))
    samples = source.read()
    assert {s[3]["gpu"] for s in samples} == {"1"} and {s[4] for s in samples} == {None}
    assert source.owned == {}
