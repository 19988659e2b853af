"""Workload files: the `benchmark_config.yaml` format (workloads of input and output tokens at
concurrency levels, the metrics to report), read verbatim, plus the keys that describe serving
scenarios (shared prefixes, request classes, multi-turn agents, open loops).

```yaml
workloads:
  - {name: short-short, input_tokens: 128, output_tokens: 64, concurrency: [1, 4, 8, 16]}
  - name: ralph-loop                     # one long static prefix + a small per-turn diff
    prefix_tokens: 6000                  # shared by every request of the workload
    input_tokens: {dist: uniform, min: 48, max: 96}   # fixed, or a distribution
    output_tokens: 16
    rate: [0.5, 1]                       # open loop (requests/s) instead of `concurrency`
    arrival: poisson                     # constant | poisson | gamma (with `burstiness`)
    requests_per_level: 12               # or duration_s
    warmup: 2                            # requests sent before measuring, not stored
    endpoint: completions                # or chat
    text: words                          # or passage | decoy (loadgen/prompts.py)
    team: search
    seed: 7
metrics: [ttft_ms, tpot_ms, qps, tokens_per_second, memory_peak_gb]
```

Everything random (sizes, class picks, arrival gaps, prompt text) is drawn from generators seeded
by the workload's `seed`, name, level and request index, so the same file gives the same
requests and the same schedule every time, whatever order the requests complete in.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import msgspec
import yaml

from servescope.store.typed import typed

DEFAULT_REQUESTS_PER_LEVEL = 32
WORKLOADS_DIR = Path(__file__).with_name("workloads")
Arrival = Literal["constant", "poisson", "gamma"]
Endpoint = Literal["completions", "chat"]
# Prompt text: a seeded word stream; the predictable tiny model's passage (its outputs repeat the
# prompt: n-gram drafts accepted); or decoys (the passage's word pairs continued otherwise: drafts
# proposed and rejected). See loadgen/prompts.py and loadgen/tiny_model.py.
Text = Literal["words", "passage", "decoy"]
ARRIVALS, ENDPOINTS, TEXTS = get_args(Arrival), get_args(Endpoint), get_args(Text)
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveNumber = Annotated[float, msgspec.Meta(gt=0)]
WORKLOAD_NAMES = {"workloads": "workload"}  # a workload is named by its `name` in errors


class WorkloadError(ValueError):
    """A workload file that cannot be run; the message says which field and why."""


class Distribution(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A token count drawn from a distribution clipped to [min, max]: `{dist: uniform, min: 64,
    max: 256}`, `{dist: normal, mean: 500, std: 100}`, `{dist: lognormal, mean: 500, std: 300,
    max: 4000}`."""

    dist: Literal["uniform", "normal", "lognormal"]
    min: PositiveInt | None = None
    max: PositiveInt | None = None
    mean: PositiveNumber | None = None
    std: PositiveNumber | None = None

    def __post_init__(self) -> None:
        if self.dist == "uniform" and (self.min is None or self.max is None):
            raise ValueError("a uniform distribution needs `min` and `max`")
        if self.dist != "uniform" and self.mean is None:
            raise ValueError(f"a {self.dist} distribution needs `mean` (and `std`)")
        if (self.min or 1) > (self.max or 10**9):
            raise ValueError("min is above max")

    def sample(self, rng: random.Random, scale: float = 1.0) -> int:
        low, high = self.min or 1, self.max or 10**9
        if self.dist == "uniform":
            drawn = rng.uniform(low, high)
        elif self.dist == "normal":
            drawn = rng.gauss(self.mean or 0.0, self.std or 0.0)
        else:  # lognormal with the given mean and std of the count itself
            mean, std = self.mean or 1.0, self.std or 0.0
            sigma2 = math.log(1 + (std / mean) ** 2)
            drawn = rng.lognormvariate(math.log(mean) - sigma2 / 2, math.sqrt(sigma2))
        return max(1, round(min(max(drawn, low), high) * scale))


# A token count: fixed (`128`), or drawn from a distribution.
Tokens = PositiveInt | Distribution


def sample(tokens: Tokens, rng: random.Random, scale: float = 1.0) -> int:
    """One request's token count, times `scale` (at least 1)."""
    if isinstance(tokens, Distribution):
        return tokens.sample(rng, scale)
    return max(1, round(tokens * scale))


class RequestClass(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One kind of request in a mixed workload (e.g. long summaries vs short probes)."""

    name: str
    input_tokens: Tokens
    output_tokens: Tokens
    weight: PositiveNumber = 1.0


class Workload(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One workload of a file, as written there (the benchmark config's keys and the
    scenarios'); its load levels are `concurrency` (closed loop) or `rate` (open loop), never
    both. A workload of request `classes` takes its sizes from them (the first class's stand for
    the workload)."""

    name: str
    input_tokens: Tokens = 0  # 0: not given, which only a workload of `classes` may do
    output_tokens: Tokens = 0
    concurrency: list[PositiveInt] = []
    rate: list[PositiveNumber] = []
    arrival: Arrival = "poisson"
    burstiness: PositiveNumber = 1.0
    requests_per_level: PositiveInt = DEFAULT_REQUESTS_PER_LEVEL
    duration_s: PositiveNumber | None = None
    warmup: NonNegativeInt = 0
    endpoint: Endpoint = "completions"
    text: Text = "words"
    team: str | None = None
    seed: int = 0
    prefix_tokens: NonNegativeInt | Distribution | None = None  # 0 (or none): no shared prefix
    classes: list[RequestClass] = []
    turns: PositiveInt = 1

    def __post_init__(self) -> None:
        if bool(self.concurrency) == bool(self.rate):
            raise ValueError(
                "give either `concurrency` (closed loop) or `rate` (open loop), "
                + ("not both" if self.concurrency else "a non-empty list of levels")
            )
        if self.classes:
            msgspec.structs.force_setattr(self, "input_tokens", self.classes[0].input_tokens)
            msgspec.structs.force_setattr(self, "output_tokens", self.classes[0].output_tokens)
        for key in ("input_tokens", "output_tokens"):
            if not getattr(self, key):
                raise ValueError(f"needs `{key}`: a positive integer or a distribution mapping")
        if self.prefix_tokens == 0:
            msgspec.structs.force_setattr(self, "prefix_tokens", None)

    @property
    def open_loop(self) -> bool:
        return bool(self.rate)

    @property
    def levels(self) -> list[int] | list[float]:
        """The load levels: concurrencies (closed loop) or target rates in requests/s."""
        return self.rate if self.open_loop else self.concurrency

    def to_dict(self) -> dict[str, Any]:
        """The workload as run, in the file's own shape (`prefix_tokens` 0 when none)."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        out["prefix_tokens"] = out["prefix_tokens"] or 0
        return out


class WorkloadFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A workload file's top level: the workloads, and defaults every workload takes unless it
    sets its own."""

    workloads: list[dict[str, Any]]  # each becomes a `Workload`, the defaults below under it
    metrics: list[str] = []
    together: bool = False  # run level i of every workload side by side
    requests_per_level: PositiveInt | None = None
    duration_s: PositiveNumber | None = None
    warmup: NonNegativeInt | None = None
    seed: int | None = None
    endpoint: Endpoint | None = None
    team: str | None = None


class _Workloads(msgspec.Struct, frozen=True):
    workloads: list[Workload]


TOP_LEVEL_DEFAULTS = ("requests_per_level", "duration_s", "warmup", "seed", "endpoint", "team")


@dataclass(frozen=True)
class BenchConfig:
    workloads: list[Workload]
    metrics: list[str] = field(default_factory=list)
    scale: float = 1.0
    together: bool = False  # run level i of every workload side by side (multi-tenant scenarios)

    def to_dict(self) -> dict[str, Any]:
        """The spec as run (after `--scale` and selection), stored as the run's `workload`."""
        return {
            "workloads": [w.to_dict() for w in self.workloads],
            "metrics": list(self.metrics),
            "scale": self.scale,
            "together": self.together,
        }

    def select(self, names: list[str]) -> BenchConfig:
        """Only the named workloads, in the given order (WorkloadError for an unknown name)."""
        by_name = {w.name: w for w in self.workloads}
        if unknown := [n for n in names if n not in by_name]:
            raise WorkloadError(f"unknown workload(s) {unknown}; the file has {sorted(by_name)}")
        return replace(self, workloads=[by_name[n] for n in names])

    def scaled(self, scale: float) -> BenchConfig:
        """`--scale`: every token size multiplied (a seed's 8K-token prefix on a CPU: 0.25)."""
        if scale <= 0:
            raise WorkloadError(f"--scale must be positive, got {scale}")
        return replace(self, scale=self.scale * scale)

    def with_requests(self, requests_per_level: int) -> BenchConfig:
        """`--requests`: every level sends this many requests (a quick or a longer run)."""
        if requests_per_level < 1:
            raise WorkloadError(f"--requests must be positive, got {requests_per_level}")
        return replace(
            self,
            workloads=[
                msgspec.structs.replace(w, requests_per_level=requests_per_level, duration_s=None)
                for w in self.workloads
            ],
        )

    def grown(self, factor: float) -> BenchConfig:
        """Every level `factor` times as long: its requests (rounded up) or its duration."""
        return replace(
            self,
            workloads=[
                msgspec.structs.replace(
                    w,
                    requests_per_level=math.ceil(w.requests_per_level * factor),
                    duration_s=w.duration_s * factor if w.duration_s is not None else None,
                )
                for w in self.workloads
            ],
        )

    def requests_total(self) -> int | None:
        """Measured requests in the whole run; None when some level runs for a duration."""
        total = 0
        for workload in self.workloads:
            if workload.duration_s is not None:
                return None
            total += workload.requests_per_level * len(workload.levels)
        return total


def parse_config(data: Any, *, source: str = "workload file") -> BenchConfig:
    """A workload file's content as a `BenchConfig`; WorkloadError names the file, the
    workload and the key: `ralph.yaml: workload 'ralph-loop': turns: expected an integer,
    got "3"`."""
    top = typed(data, WorkloadFile, source, error=WorkloadError)
    defaults = {k: v for k in TOP_LEVEL_DEFAULTS if (v := getattr(top, k)) is not None}
    raw = [{**defaults, **w} for w in top.workloads]
    workloads = typed(
        {"workloads": raw}, _Workloads, source, error=WorkloadError, names=WORKLOAD_NAMES
    ).workloads
    names = [w.name for w in workloads]
    if len(set(names)) != len(names):
        raise WorkloadError(f"{source}: workload names must be unique, got {names}")
    return BenchConfig(workloads=workloads, metrics=top.metrics, together=top.together)


def resolve(name_or_path: str | Path) -> Path:
    """A workload file path, or the name of a shipped one (`ralph-loop` → loadgen/workloads/…)."""
    path = Path(name_or_path)
    if path.exists() or path.suffix in (".yaml", ".yml"):
        return path
    shipped = WORKLOADS_DIR / f"{name_or_path}.yaml"
    return shipped if shipped.exists() else path


def shipped() -> list[str]:
    return sorted(p.stem for p in WORKLOADS_DIR.glob("*.yaml"))


def load_config(path: str | Path) -> BenchConfig:
    """Read a workload file (or a shipped scenario by name); WorkloadError says what is wrong."""
    path = resolve(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError as exc:
        raise WorkloadError(
            f"{path}: no such workload file; shipped scenarios: {', '.join(shipped())}"
        ) from exc
    except (OSError, yaml.YAMLError) as exc:
        raise WorkloadError(f"{path}: {exc}") from exc
    return parse_config(data, source=str(path))
