"""A checkpoint's weights, read from its safetensors headers (no tensor is loaded).

Each header names every tensor's dtype, shape and byte range, so the bytes are exact, quantized
and packed tensors included (an int4 GPTQ weight is its packed int32 words, its scales their own
tensors). Float tensors (F32, F16, BF16) are served at vLLM's `--dtype`, so they are kept as
values and priced at that dtype; every other tensor (int8/int4 packed, fp8, scales' integer
zero points) is served as stored. Tensors of routed experts (`.experts.` in the name) are kept
apart: expert parallelism spreads them, tensor parallelism splits the rest.

A folder with `model.safetensors.index.json` but not its shards (a config-only copy of a large
checkpoint) gives the index's `metadata.total_size`: the stored bytes, with no split by dtype.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

FLOATS = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
HEADER_LIMIT = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A weight file that cannot be read."""


@dataclass(frozen=True)
class Checkpoint:
    """What the weight files hold: float values (served at `--dtype`) and other bytes (served as
    stored), of the routed experts and of the rest; the parameter count as stored."""

    float_values: int
    other_bytes: int
    expert_float_values: int
    expert_other_bytes: int
    parameters: int
    basis: str

    def total_bytes(self, dtype_bytes: int) -> int:
        return (self.float_values + self.expert_float_values) * dtype_bytes + (
            self.other_bytes + self.expert_other_bytes
        )

    def bytes_per_gpu(self, dtype_bytes: int, tp: int, expert_ranks: int) -> int:
        """One GPU's share: the non-expert weights over TP, the experts over the expert ranks
        (TP × DP with expert parallelism, else TP)."""
        rest = self.float_values * dtype_bytes + self.other_bytes
        experts = self.expert_float_values * dtype_bytes + self.expert_other_bytes
        return math.ceil(rest / tp) + math.ceil(experts / max(expert_ranks, tp))


def _header(path: Path) -> dict[str, object]:
    with path.open("rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path} is not a safetensors file")
        (size,) = struct.unpack("<Q", raw)
        if size > HEADER_LIMIT:
            raise CheckpointError(f"{path}: safetensors header of {size} bytes")
        try:
            header = json.loads(fh.read(size))
        except ValueError as exc:
            raise CheckpointError(f"{path}: unreadable safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    return header


def _tensor(name: str, tensor: object, sums: list[int]) -> None:
    """Add one header entry to sums: [float values, other bytes, expert float values, expert
    other bytes, parameters]."""
    if name == "__metadata__" or not isinstance(tensor, dict):
        return
    values = math.prod(int(d) for d in tensor.get("shape", []))
    start, end = (tensor.get("data_offsets") or [0, 0])[:2]
    expert = 2 if ".experts." in name else 0
    if str(tensor.get("dtype")) in FLOATS:
        sums[expert] += values
    else:
        sums[expert + 1] += int(end) - int(start)
    sums[4] += values


def read(folder: Path) -> Checkpoint | None:
    """The checkpoint in `folder`: its `*.safetensors` headers, else the total size its
    `model.safetensors.index.json` states; None without either."""
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if files:
        sums = [0, 0, 0, 0, 0]
        for path in files:
            for name, tensor in _header(path).items():
                _tensor(name, tensor, sums)
        basis = (f"weights (safetensors headers of {len(files)} file(s): exact bytes, "
                 "quantized and packed tensors as stored)")  # fmt: skip
        return Checkpoint(sums[0], sums[1], sums[2], sums[3], sums[4], basis)
    index = folder / "model.safetensors.index.json" if folder.is_dir() else None
    if index is None or not index.is_file():
        return None
    try:
        meta = json.loads(index.read_text()).get("metadata") or {}
        total = int(meta["total_size"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{index}: no metadata.total_size") from None
    return Checkpoint(0, total, 0, 0, 0, basis="model.safetensors.index.json's total_size "
                      "(the stored bytes; no shard to split by dtype or by expert)")  # fmt: skip
