"""A fleet of one replica a GPU (`fleet.gpus`, benchmarks/gpu/experiments.yaml's
routing-two-gpus): each replica's server gets its own CUDA_VISIBLE_DEVICES, the file is refused
when the list does not name one value a replica, and replicas that may share a GPU are told
apart from those that cannot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from servescope.loadgen import fleet
from servescope.loadgen.launcher import load_profiles
from servescope.loadgen.spec import ExperimentError, read_experiments_file
from servescope.store import Store

ROOT = Path(__file__).resolve().parents[2]
GPU_EXPERIMENTS = ROOT / "benchmarks" / "gpu" / "experiments.yaml"
GPU_PROFILES = ROOT / "benchmarks" / "gpu" / "profiles.yaml"


def test_each_replica_gets_its_own_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SERVESCOPE_DATA_DIR", str(tmp_path))
    spec = read_experiments_file(GPU_EXPERIMENTS)["routing-two-gpus"]
    assert spec.fleet is not None and spec.fleet.gpus == ("0", "1")

    def never(*_args: Any) -> Any:
        raise AssertionError("nothing runs here")

    experiment = fleet.FleetExperiment(
        spec,
        store=Store(tmp_path / "s.duckdb"),
        execute=never,
        model=tmp_path,
        profiles=load_profiles(GPU_PROFILES),
    )
    replicas = experiment._replicas()
    assert {name: s.env["CUDA_VISIBLE_DEVICES"] for name, s in replicas.items()} == {
        "r1": "0",
        "r2": "1",
    }
    assert all(s.profile.device == "gpu" for s in replicas.values())


@pytest.mark.parametrize(
    ("gpus", "shared"),
    [(("0", "1"), False), (("0,1", "2,3"), False), (("0", "0"), True), (("0,1", "1"), True)],
)
def test_replicas_that_name_a_gpu_in_common_share_it(gpus: tuple[str, ...], shared: bool) -> None:
    assert fleet._overlap(gpus) is shared


def test_a_gpu_list_of_the_wrong_length_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "experiments.yaml"
    path.write_text(
        "experiments:\n  bad:\n    workload: gpu-multi-tenant-prefixes\n"
        "    fleet: {replicas: 2, profile: gpu-bench, gpus: ['0']}\n"
        "    profiles: [round-robin, prefix-affinity]\n"
    )
    with pytest.raises(ExperimentError, match="one CUDA_VISIBLE_DEVICES value a replica"):
        read_experiments_file(path)
