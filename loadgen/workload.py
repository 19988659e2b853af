"""Workload files: Lab 10's `benchmark_config.yaml` format, read verbatim, plus the keys that
describe the seeds' scenarios (shared prefixes, request classes, multi-turn agents, open loops).

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
    team: lab10
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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

DEFAULT_REQUESTS_PER_LEVEL = 32
WORKLOADS_DIR = Path(__file__).with_name("workloads")
ARRIVALS = ("constant", "poisson", "gamma")
ENDPOINTS = ("completions", "chat")
# Prompt text: a seeded word stream; the predictable tiny model's passage (its outputs repeat the
# prompt: n-gram drafts accepted); or decoys (the passage's word pairs continued otherwise: drafts
# proposed and rejected). See loadgen/prompts.py and loadgen/tiny_model.py.
TEXTS = ("words", "passage", "decoy")
DISTRIBUTIONS = ("uniform", "normal", "lognormal")


class WorkloadError(ValueError):
    """A workload file that cannot be run; the message says which field and why."""


@dataclass(frozen=True)
class Tokens:
    """A token count: fixed (`value`), or drawn from a distribution clipped to [min, max]."""

    value: int | None = None
    dist: str | None = None
    min: int | None = None
    max: int | None = None
    mean: float | None = None
    std: float | None = None

    def sample(self, rng: random.Random, scale: float = 1.0) -> int:
        if self.value is not None:
            return max(1, round(self.value * scale))
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

    def to_yaml(self) -> int | dict[str, Any]:
        if self.value is not None:
            return self.value
        return {k: v for k, v in asdict(self).items() if v is not None and k != "value"}


@dataclass(frozen=True)
class RequestClass:
    """One kind of request in a mixed workload (e.g. long summaries vs short probes)."""

    name: str
    input_tokens: Tokens
    output_tokens: Tokens
    weight: float = 1.0


@dataclass(frozen=True)
class Workload:
    name: str
    input_tokens: Tokens
    output_tokens: Tokens
    concurrency: list[int] = field(default_factory=list)
    rate: list[float] = field(default_factory=list)
    arrival: str = "poisson"
    burstiness: float = 1.0
    requests_per_level: int = DEFAULT_REQUESTS_PER_LEVEL
    duration_s: float | None = None
    warmup: int = 0
    endpoint: str = "completions"
    text: str = "words"
    team: str | None = None
    seed: int = 0
    prefix_tokens: Tokens | None = None
    classes: list[RequestClass] = field(default_factory=list)
    turns: int = 1

    @property
    def open_loop(self) -> bool:
        return bool(self.rate)

    @property
    def levels(self) -> list[int] | list[float]:
        """The load levels: concurrencies (closed loop) or target rates in requests/s."""
        return self.rate if self.open_loop else self.concurrency


@dataclass(frozen=True)
class BenchConfig:
    workloads: list[Workload]
    metrics: list[str] = field(default_factory=list)
    scale: float = 1.0
    together: bool = False  # run level i of every workload side by side (multi-tenant scenarios)

    def to_dict(self) -> dict[str, Any]:
        """The spec as run (after `--scale` and selection), stored as the run's `workload`."""
        out: dict[str, Any] = asdict(self)
        for raw, workload in zip(out["workloads"], self.workloads, strict=True):
            raw["input_tokens"] = workload.input_tokens.to_yaml()
            raw["output_tokens"] = workload.output_tokens.to_yaml()
            raw["prefix_tokens"] = workload.prefix_tokens.to_yaml() if workload.prefix_tokens else 0
            for raw_class, cls in zip(raw["classes"], workload.classes, strict=True):
                raw_class["input_tokens"] = cls.input_tokens.to_yaml()
                raw_class["output_tokens"] = cls.output_tokens.to_yaml()
        return out

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
                replace(w, requests_per_level=requests_per_level, duration_s=None)
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


KNOWN_KEYS = set(Workload.__dataclass_fields__)
TOP_LEVEL_DEFAULTS = ("requests_per_level", "duration_s", "warmup", "seed", "endpoint", "team")


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise WorkloadError(f"{where} must be a positive integer, got {value!r}")
    return value


def _non_negative_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise WorkloadError(f"{where} must be a non-negative integer, got {value!r}")
    return value


def _positive_number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise WorkloadError(f"{where} must be a positive number, got {value!r}")
    return float(value)


def parse_tokens(value: Any, where: str) -> Tokens:
    """`128`, or `{dist: uniform, min: 64, max: 256}`, `{dist: normal, mean: 500, std: 100}`,
    `{dist: lognormal, mean: 500, std: 300, max: 4000}`."""
    if isinstance(value, int) and not isinstance(value, bool):
        return Tokens(value=_positive_int(value, where))
    if not isinstance(value, dict):
        raise WorkloadError(f"{where} must be a positive integer or a distribution mapping")
    dist = value.get("dist")
    if dist not in DISTRIBUTIONS:
        raise WorkloadError(f"{where}: `dist` must be one of {DISTRIBUTIONS}, got {dist!r}")
    if unknown := sorted(set(value) - {"dist", "min", "max", "mean", "std"}):
        raise WorkloadError(f"{where}: unknown keys {unknown}")
    bounds = {k: _positive_int(value[k], f"{where}.{k}") for k in ("min", "max") if k in value}
    if dist == "uniform" and set(bounds) != {"min", "max"}:
        raise WorkloadError(f"{where}: a uniform distribution needs `min` and `max`")
    if dist != "uniform" and "mean" not in value:
        raise WorkloadError(f"{where}: a {dist} distribution needs `mean` (and `std`)")
    if bounds.get("min", 1) > bounds.get("max", 10**9):
        raise WorkloadError(f"{where}: min is above max")
    moments = {k: _positive_number(value[k], f"{where}.{k}") for k in ("mean", "std") if k in value}
    return Tokens(dist=dist, **bounds, **moments)


def _levels(raw: dict[str, Any], where: str) -> tuple[list[int], list[float]]:
    concurrency, rate = raw.get("concurrency"), raw.get("rate")
    if (concurrency is None) == (rate is None):
        raise WorkloadError(
            f"{where}: give either `concurrency` (closed loop) or `rate` (open loop), not "
            + ("both" if concurrency is not None else "neither")
        )
    if concurrency is not None:
        if not isinstance(concurrency, list) or not concurrency:
            raise WorkloadError(f"{where}: `concurrency` must be a non-empty list")
        return [_positive_int(c, f"{where}: concurrency") for c in concurrency], []
    if not isinstance(rate, list) or not rate:
        raise WorkloadError(f"{where}: `rate` must be a non-empty list of requests/s")
    return [], [_positive_number(r, f"{where}: rate") for r in rate]


def _classes(raw: Any, where: str) -> list[RequestClass]:
    if raw is None:
        return []
    if not isinstance(raw, list) or not raw:
        raise WorkloadError(f"{where}: `classes` must be a non-empty list")
    classes = []
    for i, item in enumerate(raw):
        spot = f"{where}: classes[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise WorkloadError(f"{spot} needs a `name`")
        if unknown := sorted(set(item) - {"name", "input_tokens", "output_tokens", "weight"}):
            raise WorkloadError(f"{spot}: unknown keys {unknown}")
        classes.append(
            RequestClass(
                name=item["name"],
                input_tokens=parse_tokens(item.get("input_tokens"), f"{spot}.input_tokens"),
                output_tokens=parse_tokens(item.get("output_tokens"), f"{spot}.output_tokens"),
                weight=_positive_number(item.get("weight", 1), f"{spot}.weight"),
            )
        )
    return classes


def parse_workload(raw: Any, defaults: dict[str, Any], where: str) -> Workload:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise WorkloadError(f"{where} needs a `name`")
    where = f"{where.rsplit(':', 1)[0]}: workload {raw['name']!r}"
    if unknown := sorted(set(raw) - KNOWN_KEYS):
        raise WorkloadError(f"{where}: unknown keys {unknown}; known: {sorted(KNOWN_KEYS)}")
    raw = {**defaults, **raw}
    concurrency, rate = _levels(raw, where)
    classes = _classes(raw.get("classes"), where)
    if classes:
        input_tokens, output_tokens = classes[0].input_tokens, classes[0].output_tokens
    else:
        input_tokens = parse_tokens(raw.get("input_tokens"), f"{where}: input_tokens")
        output_tokens = parse_tokens(raw.get("output_tokens"), f"{where}: output_tokens")
    arrival = raw.get("arrival", "poisson")
    if arrival not in ARRIVALS:
        raise WorkloadError(f"{where}: arrival must be one of {ARRIVALS}, got {arrival!r}")
    endpoint = raw.get("endpoint", "completions")
    if endpoint not in ENDPOINTS:
        raise WorkloadError(f"{where}: endpoint must be completions or chat, got {endpoint!r}")
    text = raw.get("text", "words")
    if text not in TEXTS:
        raise WorkloadError(f"{where}: text must be one of {TEXTS}, got {text!r}")
    duration = raw.get("duration_s")
    prefix = raw.get("prefix_tokens")
    return Workload(
        name=raw["name"],
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        concurrency=concurrency,
        rate=rate,
        arrival=arrival,
        burstiness=_positive_number(raw.get("burstiness", 1.0), f"{where}: burstiness"),
        requests_per_level=_positive_int(
            raw.get("requests_per_level", DEFAULT_REQUESTS_PER_LEVEL),
            f"{where}: requests_per_level",
        ),
        duration_s=None if duration is None else _positive_number(duration, f"{where}: duration_s"),
        warmup=_non_negative_int(raw.get("warmup", 0), f"{where}: warmup"),
        endpoint=endpoint,
        text=text,
        team=None if raw.get("team") is None else str(raw["team"]),
        seed=int(raw.get("seed", 0)),
        prefix_tokens=None if not prefix else parse_tokens(prefix, f"{where}: prefix_tokens"),
        classes=classes,
        turns=_positive_int(raw.get("turns", 1), f"{where}: turns"),
    )


def parse_config(data: Any, *, source: str = "workload file") -> BenchConfig:
    if not isinstance(data, dict) or not isinstance(data.get("workloads"), list):
        raise WorkloadError(f"{source}: needs a top-level `workloads:` list")
    defaults = {k: data[k] for k in TOP_LEVEL_DEFAULTS if k in data}
    workloads = [
        parse_workload(raw, defaults, f"{source}: workloads[{i}]")
        for i, raw in enumerate(data["workloads"])
    ]
    names = [w.name for w in workloads]
    if len(set(names)) != len(names):
        raise WorkloadError(f"{source}: workload names must be unique, got {names}")
    metrics = data.get("metrics") or []
    together = data.get("together", False)
    if not isinstance(together, bool):
        raise WorkloadError(f"{source}: together must be true or false, got {together!r}")
    return BenchConfig(workloads=workloads, metrics=[str(m) for m in metrics], together=together)


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
