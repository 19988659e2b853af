"""Experiment specs: an experiments file (the built-in `experiments.yaml`, or an operator's in
the same format) read into typed `ExperimentSpec`s, with errors that name the file, the
experiment and the key; the arms a spec's profiles make.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import msgspec

from servescope.loadgen.launcher import Profile, read_section
from servescope.loadgen.workload import BenchConfig, WorkloadError, load_config
from servescope.store.typed import Named, typed

EXPERIMENTS_FILE = Path(__file__).with_name("experiments.yaml")


class ExperimentError(WorkloadError):
    """An experiments file (or a spec in it) that cannot be run; the message says where."""


@dataclass(frozen=True)
class FleetSpec:
    """Replicas behind the gateway (loadgen/fleet.py): how many, their server profile and, for
    one replica a GPU, the `CUDA_VISIBLE_DEVICES` of each (`gpus`, one entry a replica)."""

    replicas: int
    profile: str
    gpus: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExperimentSpec:
    name: str
    description: str
    workload: str
    profiles: list[str]
    workloads: list[str] = field(default_factory=list)
    scale: float = 1.0
    requests: int | None = None
    model: str = "random"  # a tiny model kind (loadgen/tiny_model.py KINDS), or a model folder
    fleet: FleetSpec | None = None  # set: `profiles` are the gateway's routing policies
    repeats: int | None = None  # a fixed design's rounds; None: until decided (loadgen/rounds.py)
    source: str = "built-in"  # the experiments file it came from

    @property
    def arms(self) -> list[str]:
        return arm_names(self.profiles)

    def bench_config(self, scale: float | None, requests: int | None) -> BenchConfig:
        """The workload every run of the experiment sends: the spec's workloads, with the
        command line's request count and scale over the spec's own."""
        config = load_config(self.workload)
        if self.workloads:
            config = config.select(self.workloads)
        requests = requests if requests is not None else self.requests
        if requests is not None:
            config = config.with_requests(requests)  # WorkloadError below 1
        return config.scaled(scale if scale is not None else self.scale)


def arm_names(profiles: list[str]) -> list[str]:
    """An arm per profile, named after it; a profile named more than once (an A/A spec) gives
    arms `<profile>-a`, `<profile>-b`, … so that runs and reports stay apart."""
    counts = {p: profiles.count(p) for p in profiles}
    seen: dict[str, int] = {}
    names = []
    for profile in profiles:
        if counts[profile] == 1:
            names.append(profile)
            continue
        seen[profile] = seen.get(profile, 0) + 1
        names.append(f"{profile}-{chr(ord('a') + seen[profile] - 1)}")
    return names


# -- experiments files ---------------------------------------------------------------------

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Name = Annotated[str, msgspec.Meta(min_length=1)]


class FleetEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An experiment's `fleet` as the file writes it."""

    replicas: PositiveInt
    profile: str
    gpus: list[str] = []


class ExperimentEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An experiment as an experiments file writes it (a key null is a key left out where
    that has a meaning: no `requests`, no `workloads`, no `fleet`)."""

    workload: Name
    profiles: list[Name]
    description: str = ""
    workloads: list[str] | None = None
    scale: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    requests: PositiveInt | None = None
    model: str = "random"
    fleet: FleetEntry | None = None
    repeats: PositiveInt | None = None


def _spec(name: str, raw: Any, source: Path) -> ExperimentSpec:
    entry = typed(
        raw, ExperimentEntry, str(source), error=ExperimentError, at=[Named("experiment", name)]
    )
    where = f"{source}: experiment {name!r}"
    if len(entry.profiles) < 2:
        raise ExperimentError(
            f"{where}: `profiles` must list at least two profiles (the first is the before; "
            "name one twice for an A/A run)"
        )
    fleet = None
    if entry.fleet is not None:
        replicas, gpus = entry.fleet.replicas, entry.fleet.gpus
        if gpus and len(gpus) != replicas:
            raise ExperimentError(
                f"{where}: `fleet.gpus` is one CUDA_VISIBLE_DEVICES value a replica "
                f'({replicas}), e.g. ["0", "1"]'
            )
        fleet = FleetSpec(replicas, entry.fleet.profile, tuple(gpus))
    workload, model = entry.workload, entry.model
    if source != EXPERIMENTS_FILE:  # an operator's paths are relative to their file
        workload = _beside(source, workload)
        model = _beside(source, model)
    return ExperimentSpec(
        name=name,
        description=" ".join(entry.description.split()),
        workload=workload,
        profiles=list(entry.profiles),
        workloads=list(entry.workloads or []),
        scale=entry.scale,
        requests=entry.requests,
        model=model,
        fleet=fleet,
        repeats=entry.repeats,
        source="built-in" if source == EXPERIMENTS_FILE else str(source),
    )


def _beside(source: Path, value: str) -> str:
    """A relative path of an operator's file as it is from their file's folder, where one is
    there (a shipped workload's or a tiny model kind's name stays as it is)."""
    path = Path(value)
    if path.is_absolute() or not (source.parent / path).exists():
        return value
    return str(source.parent / path)


def read_experiments_file(path: Path) -> dict[str, ExperimentSpec]:
    """One experiments file's specs; ExperimentError names the file and what is wrong."""
    section = read_section(path, "experiments", ExperimentError)
    return {str(name): _spec(str(name), raw, Path(path)) for name, raw in section.items()}


def load_experiments(path: Path | None = None) -> dict[str, ExperimentSpec]:
    """The built-in experiments, with those of `path` (an operator's file in the same format)
    added over them: one of theirs replaces a built-in one of the same name."""
    experiments = read_experiments_file(EXPERIMENTS_FILE)
    if path is not None:
        experiments.update(read_experiments_file(path))
    return experiments


def check_profiles(spec: ExperimentSpec, profiles: dict[str, Profile]) -> None:
    """ExperimentError when a spec names a profile the profiles do not define."""
    named = [spec.fleet.profile] if spec.fleet else spec.profiles
    if unknown := sorted({p for p in named if p not in profiles}):
        raise ExperimentError(
            f"experiment {spec.name}: unknown profiles {unknown}; known: {', '.join(profiles)}"
        )
