"""Per-request arrays of one slice of a run: what the bootstrap resamples and the charts draw.

One query fetches every request of the slice as numpy columns (a million requests are ~100 MB),
so the diff never walks Python objects per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import duckdb
import numpy as np

from reports.bootstrap import Floats
from store import queries


@dataclass(frozen=True)
class Slice:
    """A run, or the part of it in [since, until): what one side of a report describes."""

    run_id: str
    since: datetime | None = None
    until: datetime | None = None
    label: str = ""

    def params(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "since": self.since, "until": self.until}

    @property
    def name(self) -> str:
        return self.label or self.run_id


def _floats(column: Any) -> Floats:
    """A fetched column as float64 with NaN where the value was NULL."""
    if isinstance(column, np.ma.MaskedArray):
        return np.ma.filled(column.astype(np.float64), np.nan)
    return np.asarray(column, dtype=np.float64)


@dataclass
class Samples:
    """The slice's requests, one array element per request (NaN = not measured)."""

    t: Floats
    ok: np.ndarray
    columns: dict[str, Floats]
    _sorted: dict[str, Floats] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.ok)

    def successful(self, metric: str) -> Floats:
        """The metric over successful requests where it was measured, sorted (cached)."""
        if metric not in self._sorted:
            values = self.columns[metric][self.ok]
            self._sorted[metric] = np.sort(values[~np.isnan(values)])
        return self._sorted[metric]


def load_samples(con: duckdb.DuckDBPyConnection, part: Slice) -> Samples:
    data = con.execute(queries.SLICE_SAMPLES, part.params()).fetchnumpy()
    ok = np.ma.filled(data["ok"], False).astype(bool) if len(data["ok"]) else np.zeros(0, bool)
    names = (
        *queries.REPORT_LATENCY_METRICS,
        "prompt_tokens",
        "completion_tokens",
        "cache_hit",
    )
    return Samples(t=_floats(data["t"]), ok=ok, columns={k: _floats(data[k]) for k in names})
