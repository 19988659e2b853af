"""Workload files: the Lab 10 `benchmark_config.yaml` format, read verbatim.

```yaml
workloads:
  - {name: short-short, input_tokens: 128, output_tokens: 64, concurrency: [1, 4, 8, 16]}
metrics: [ttft_ms, tpot_ms, qps, tokens_per_second, memory_peak_gb]
```
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

DEFAULT_REQUESTS_PER_LEVEL = 32


class WorkloadError(ValueError):
    """A workload file that cannot be run; the message says which field and why."""


@dataclass(frozen=True)
class Workload:
    name: str
    input_tokens: int
    output_tokens: int
    concurrency: list[int]
    requests_per_level: int = DEFAULT_REQUESTS_PER_LEVEL
    endpoint: str = "completions"
    seed: int = 0


@dataclass(frozen=True)
class BenchConfig:
    workloads: list[Workload]
    metrics: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise WorkloadError(f"{where} must be a positive integer, got {value!r}")
    return value


def parse_config(data: Any, *, source: str = "workload file") -> BenchConfig:
    if not isinstance(data, dict) or not isinstance(data.get("workloads"), list):
        raise WorkloadError(f"{source}: needs a top-level `workloads:` list")
    default_rpl = data.get("requests_per_level", DEFAULT_REQUESTS_PER_LEVEL)
    workloads = []
    for i, raw in enumerate(data["workloads"]):
        where = f"{source}: workloads[{i}]"
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            raise WorkloadError(f"{where} needs a `name`")
        where = f"{source}: workload {raw['name']!r}"
        known = {f for f in Workload.__dataclass_fields__}
        if unknown := sorted(set(raw) - known):
            raise WorkloadError(f"{where}: unknown keys {unknown}; known: {sorted(known)}")
        levels = raw.get("concurrency")
        if not isinstance(levels, list) or not levels:
            raise WorkloadError(f"{where}: `concurrency` must be a non-empty list")
        endpoint = raw.get("endpoint", "completions")
        if endpoint not in ("completions", "chat"):
            raise WorkloadError(f"{where}: endpoint must be completions or chat")
        workloads.append(
            Workload(
                name=raw["name"],
                input_tokens=_positive_int(raw.get("input_tokens"), f"{where}: input_tokens"),
                output_tokens=_positive_int(raw.get("output_tokens"), f"{where}: output_tokens"),
                concurrency=[_positive_int(c, f"{where}: concurrency") for c in levels],
                requests_per_level=_positive_int(
                    raw.get("requests_per_level", default_rpl), f"{where}: requests_per_level"
                ),
                endpoint=endpoint,
                seed=int(raw.get("seed", 0)),
            )
        )
    metrics = data.get("metrics") or []
    return BenchConfig(workloads=workloads, metrics=[str(m) for m in metrics])


def load_config(path: Path) -> BenchConfig:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise WorkloadError(f"{path}: {exc}") from exc
    return parse_config(data, source=str(path))
