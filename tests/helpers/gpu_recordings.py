"""The GPU recordings (tests/fixtures/gpu/): NVML samples and a dcgm-exporter page."""

from __future__ import annotations

import json
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gpu"


NVML = FIXTURES / "nvml-samples.jsonl"


DCGM = FIXTURES / "dcgm-exporter.txt"


def nvml_records() -> list[dict]:
    return [json.loads(line) for line in NVML.read_text().splitlines() if line.strip()]
