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


CLIENT, SERVER = "client", "server"
# The client's indicators vLLM measures too (its trace; its decode time for TPOT): the column of
# the server's figure for each.
SERVER_FIGURES = {m: f"server_{m}" for m in ("ttft_ms", "tpot_ms", "e2e_ms")}
# Where the other indicators come from: the client's stream, vLLM's trace.
FIXED_SOURCES = {"itl_ms": CLIENT, "queue_ms": SERVER, "prefill_ms": SERVER, "decode_ms": SERVER}


@dataclass
class Samples:
    """The slice's requests, one array element per request (NaN = not measured).

    `columns["ttft_ms"]` (and TPOT, e2e) is the figure of the source `sources` names: the
    client's by default, vLLM's own after `use({"ttft_ms": SERVER})`; the client's stays under
    `client_ttft_ms`.
    """

    t: Floats
    ok: np.ndarray
    columns: dict[str, Floats]
    sources: dict[str, str] = field(default_factory=lambda: dict.fromkeys(SERVER_FIGURES, CLIENT))
    _sorted: dict[str, Floats] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.ok)

    def measured(self, metric: str) -> int:
        """How many successful requests have this metric."""
        values = self.columns[metric][self.ok]
        return int(np.count_nonzero(~np.isnan(values)))

    def use(self, sources: dict[str, str]) -> None:
        """Report each indicator from the given source (see `choose_sources`)."""
        for metric, source in sources.items():
            figure = SERVER_FIGURES[metric] if source == SERVER else f"client_{metric}"
            self.columns[metric] = self.columns[figure]
            self._sorted.pop(metric, None)
        self.sources = {**self.sources, **sources}

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
        *queries.SERVER_LATENCY,
        "prompt_tokens",
        "completion_tokens",
        "cache_hit",
    )
    columns = {k: _floats(data[k]) for k in names}
    columns.update({f"client_{m}": columns[m] for m in SERVER_FIGURES})
    return Samples(t=_floats(data["t"]), ok=ok, columns=columns)


def choose_sources(*sides: Samples) -> dict[str, str]:
    """Per indicator, the one source every side is reported from: the client's figure unless
    vLLM's own covers more requests on every side (a server nobody benchmarked, clients that
    time nothing). A comparison never mixes a client figure with a server figure."""
    chosen = {}
    for metric, server in SERVER_FIGURES.items():
        client_n = min(s.measured(f"client_{metric}") for s in sides)
        server_n = min(s.measured(server) for s in sides)
        chosen[metric] = SERVER if server_n > client_n else CLIENT
    return chosen
