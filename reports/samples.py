"""What a report reads per request of one slice of a run, in bounded memory whatever its size.

A long-lived server's run has tens of millions of requests; holding them as per-request columns
would grow with the run. So nothing per request is kept: each latency metric is fetched alone
(successful requests, NULL-free, sorted by DuckDB), reduced at once to what the report needs
(`Sorted`: its mean, its CDF points, and the values near the ranks a quantile or its bootstrap
draws read), and dropped before the next is fetched. Counts, per-window totals and the TTFT
timeline are aggregated in SQL. Peak memory is one metric's column on each side at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import duckdb
import numpy as np
from numpy.typing import NDArray

from servescope.reports import sql
from servescope.reports.bootstrap import Floats, quantile
from servescope.reports.document import OneChunkStreams
from servescope.reports.quantiles import QUANTILES, by_level
from servescope.reports.sql import SliceParams
from servescope.reports.svg import cdf_series
from servescope.store import reads
from servescope.wire.slo import SLO_METRICS

CLIENT, SERVER = "client", "server"
# The client's indicators vLLM measures too (its trace; its decode time for TPOT): the figure
# of the server's for each (`sql.SERVER_LATENCY`).
SERVER_FIGURES = {m: f"server_{m}" for m in ("ttft_ms", "tpot_ms", "e2e_ms")}
# Where the other indicators come from: the client's stream, vLLM's trace.
FIXED_SOURCES = {"itl_ms": CLIENT, "queue_ms": SERVER, "prefill_ms": SERVER, "decode_ms": SERVER}

# The quantiles the bootstrap tests (the summary shows `reports.quantiles.QUANTILES`).
TESTED = {"p50": 0.5, "p95": 0.95, "p99": 0.99}
# A quantile's bootstrap draws read ranks within a few standard deviations (√(n·q·(1 − q))) of
# its own; 10 of them on each side leaves out a draw with odds below 1e-22, and a draw outside
# fetches the column again, so the result is exact either way. Below KEEP_ALL values the whole
# column is kept (1 MiB).
SPREAD_SD = 10.0
SPREAD_MARGIN = 64  # ranks beyond: the upper order statistic of an interpolated draw
KEEP_ALL = 1 << 17


@dataclass(frozen=True)
class Slice:
    """A run, or the part of it in [since, until): what one side of a report describes."""

    run_id: str
    since: datetime | None = None
    until: datetime | None = None
    label: str = ""

    def params(self) -> SliceParams:
        return SliceParams(run_id=self.run_id, since=self.since, until=self.until)

    @property
    def name(self) -> str:
        return self.label or self.run_id


def _kept_ranges(n: int) -> list[tuple[int, int]]:
    """[start, stop) rank ranges to keep of n sorted values: around each summary quantile."""
    if n <= KEEP_ALL:
        return [(0, n)]
    ranges = []
    for q in QUANTILES:
        centre, spread = (n - 1) * q, SPREAD_SD * math.sqrt(n * q * (1 - q))
        ranges.append(
            (max(0, int(centre - spread) - 2), min(n, int(centre + spread) + SPREAD_MARGIN))
        )
    merged: list[tuple[int, int]] = []
    for start, stop in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


class Sorted:
    """A metric's values over the slice's successful requests, sorted, kept only where a report
    reads them. Indexes like the full sorted array (an int or an array of ints); an index outside
    what is kept fetches the column again (exact, only slower)."""

    def __init__(self, values: Floats, fetch: Callable[[], Floats]) -> None:
        self.n = len(values)
        self.mean = float(values.mean()) if self.n else None
        self.quantiles = [quantile(values, q) for q in QUANTILES] if self.n else None
        self.cdf = cdf_series("", values)
        self._parts = [(start, values[start:stop].copy()) for start, stop in _kept_ranges(self.n)]
        self._fetch = fetch

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: Any) -> Any:
        at = np.asarray(index)
        if at.size == 0:
            return np.zeros(at.shape)
        lo, hi = int(at.min()), int(at.max())
        for start, part in self._parts:
            if start <= lo and hi < start + len(part):
                return part[at - start]
        return self._fetch()[at]


@dataclass(frozen=True)
class Counts:
    """The slice's request counts, cache-hit flags and time span (epoch seconds)."""

    requests: int
    ok: int
    cache_known: int
    cache_hits: int
    first_t: float | None
    last_t: float | None
    input_known: int
    output_known: int
    input_tokens: float
    output_tokens: float
    level_keys: list[int]  # of the levels with a successful request
    itl_gaps: int  # ITL gaps of successful requests (an upper bound: NULL gaps included)


@dataclass
class Samples:
    """One slice's per-request numbers, read on demand on the slice's own cursor (kept open by
    the caller for as long as the report is being built).

    TTFT, TPOT and e2e are read from the source `sources` names: the client's figure by
    default, vLLM's own after `use({"ttft_ms": SERVER})` (see `choose_sources`).
    """

    con: duckdb.DuckDBPyConnection
    part: Slice
    sources: dict[str, str] = field(default_factory=lambda: dict.fromkeys(SERVER_FIGURES, CLIENT))
    _measured: dict[str, int] | None = None
    _sorted: dict[str, Sorted] = field(default_factory=dict)
    _levels: dict[str, dict[int, list[float | None]]] = field(default_factory=dict)
    _level_sorted: dict[str, dict[int, Sorted]] = field(default_factory=dict)
    _level_names: dict[tuple[Any, Any, Any], int] | None = None
    _counts: Counts | None = None
    _windows: dict[tuple[Any, ...], dict[str, Floats]] = field(default_factory=dict)

    def _fetch(self, metric: str) -> tuple[Floats, NDArray[np.uint64]]:
        data = self.con.execute(sql.SLICE_METRIC[metric], self.part.params()).fetchnumpy()
        values = np.require(data["v"], dtype=np.float64, requirements="W")
        return values, np.asarray(data["level_key"], dtype=np.uint64)

    def _fetch_sorted(self, metric: str) -> Floats:
        values, _ = self._fetch(metric)
        values.sort()
        return values

    def figure(self, metric: str) -> str:
        """The per-request figure a metric is read from (its own, or vLLM's)."""
        if metric in SERVER_FIGURES and self.sources.get(metric) == SERVER:
            return SERVER_FIGURES[metric]
        return metric

    def one_chunk_share(self) -> float:
        """The share of the slice's successful multi-token streams that arrived all at once
        (no client TPOT: `sql.ONE_CHUNK`)."""
        self.measured("tpot_ms")
        assert self._measured is not None
        streams = int(self._measured["multi_token"])
        return int(self._measured["one_chunk"]) / streams if streams else 0.0

    def one_chunk(self) -> OneChunkStreams:
        """How many successful streams carry no client TPOT for arriving in one chunk."""
        self.measured("tpot_ms")
        assert self._measured is not None
        return OneChunkStreams(
            streams=int(self._measured["one_chunk"]),
            share=self.one_chunk_share(),
            tpot_source=self.sources.get("tpot_ms", CLIENT),
        )

    def use(self, sources: dict[str, str]) -> None:
        self.sources = {**self.sources, **sources}

    def measured(self, figure: str) -> int:
        """How many successful requests have this per-request figure."""
        if self._measured is None:
            # an aggregate without GROUP BY: always one row
            self._measured = reads.row(self.con.execute(sql.SLICE_MEASURED, self.part.params()))
            assert self._measured is not None
        return int(self._measured[figure])

    def successful(self, metric: str) -> Sorted:
        """The metric over successful requests where it was measured, sorted (reduced once,
        with its per-level quantiles)."""
        metric = self.figure(metric)
        if metric not in self._sorted:
            values, keys = self._fetch(metric)
            self._levels[metric] = by_level(values, keys, self.counts.level_keys)
            del keys
            values.sort()  # in place: the column is held once
            self._sorted[metric] = Sorted(values, lambda: self._fetch_sorted(metric))
        return self._sorted[metric]

    def _level_values(
        self, metric: str, values: Floats, keys: NDArray[np.uint64], key: int
    ) -> Sorted:
        def fetch() -> Floats:
            again, again_keys = self._fetch(metric)
            mine = again[again_keys == np.uint64(key)]
            mine.sort()
            return mine

        mine = values[keys == np.uint64(key)]  # a copy
        mine.sort()
        return Sorted(mine, fetch)

    def level_successful(self, metric: str) -> dict[int, Sorted]:
        """`successful(metric)` per level key (one level: the same object as the whole). Only a
        diff compares levels one by one: a run's summary never pays for this second fetch."""
        whole = self.successful(metric)
        figure = self.figure(metric)
        if figure not in self._level_sorted:
            levels = self.counts.level_keys
            if len(levels) < 2:
                self._level_sorted[figure] = dict.fromkeys(levels, whole)
            else:
                values, keys = self._fetch(figure)
                self._level_sorted[figure] = {
                    key: self._level_values(figure, values, keys, key) for key in levels
                }
        return self._level_sorted[figure]

    def level_key(self, workload: Any, concurrency: Any, target_rate: Any) -> int | None:
        """The key `successful` and `level_quantiles` file a level under (None: no such level
        with a successful request)."""
        if self._level_names is None:
            rows = self.con.execute(sql.SLICE_LEVEL_KEYS, self.part.params()).fetchall()
            self._level_names = {(w, c, r): int(k) for w, c, r, k in rows}
        return self._level_names.get((workload, concurrency, target_rate))

    def level_quantiles(self, metric: str) -> dict[int, list[float | None]]:
        """[p50, p90, p95, p99] of the metric per level key (levels where it was measured)."""
        self.successful(metric)
        return self._levels[self.figure(metric)]

    @property
    def counts(self) -> Counts:
        if self._counts is None:
            row = self.con.execute(sql.SLICE_SAMPLE_COUNTS, self.part.params()).fetchone()
            assert row is not None  # an aggregate without GROUP BY gives one row
            self._counts = Counts(*row)
        return self._counts

    @property
    def n(self) -> int:
        return self.counts.requests

    @property
    def span(self) -> tuple[float, float] | None:
        """Epoch seconds of the first and last request start (None: no timestamps)."""
        c = self.counts
        return (c.first_t, c.last_t) if c.first_t is not None and c.last_t is not None else None

    def window_totals(
        self, width: float, count: int, slo: dict[str, float]
    ) -> dict[str, Floats] | None:
        """Per-window totals (`ok`, `input_tokens`, `output_tokens`, `good`) of the successful
        requests over `count` windows of `width` seconds from the slice's first start, each
        request spread over the spans where its work happened (`sql.SLICE_WINDOW_TOTALS`);
        None when no request has a timestamp."""
        span = self.span
        if span is None:
            return None
        key = (width, count, tuple(sorted(slo.items())))
        if key not in self._windows:
            params = {
                **self.part.params(),
                "t0": span[0],
                "width": width,
                "count": count,
                **{f"slo_{m}": slo.get(m) for m in SLO_METRICS},
            }
            data = self.con.execute(sql.SLICE_WINDOW_TOTALS, params).fetchnumpy()
            self._windows[key] = {
                name: _spread_totals(data, name, count)
                for name in ("ok", "input_tokens", "output_tokens", "good")
            }
        return self._windows[key]

    def ttft_over_time(self, buckets: int) -> tuple[Floats, Floats, float | None]:
        """Successful requests' start times (epoch s) and TTFT: every point when there are at
        most 2 × `buckets`, else the median of each non-empty one of `buckets` equal time
        buckets at its middle, and the buckets' width in seconds (None for points)."""
        params = self.part.params()
        row = self.con.execute(sql.SLICE_TTFT_SPAN, params).fetchone()
        n, lo, hi = row if row else (0, None, None)
        if not n or lo is None or hi is None:
            return np.zeros(0), np.zeros(0), None
        if n <= 2 * buckets:
            data = self.con.execute(sql.SLICE_TTFT_POINTS, params).fetchnumpy()
            return _floats(data["t"]), _floats(data["ttft_ms"]), None
        width = (hi - lo) / buckets if hi > lo else 1.0
        data = self.con.execute(
            sql.SLICE_TTFT_BUCKETS, {**params, "t0": lo, "width": width, "last": buckets - 1}
        ).fetchnumpy()
        middle = lo + (np.asarray(data["b"], dtype=np.float64) + 0.5) * width
        return middle, _floats(data["ttft_ms"]), width


def _floats(column: Any) -> Floats:
    return np.asarray(column, dtype=np.float64)


# The share of a side's multi-token streams that may arrive in one chunk (no client TPOT) before
# TPOT is read from vLLM's own record instead, where every side has it.
ONE_CHUNK_TOLERANCE = 0.1


def choose_sources(*sides: Samples) -> dict[str, str]:
    """Per indicator, the one source every side is reported from: the client's figure where
    every side has one, else vLLM's own (a server nobody benchmarked, clients that time
    nothing). TPOT also comes from vLLM where more than a tenth of a side's streams arrived in
    one chunk (a busy server flushing whole answers: the client saw no decode). A comparison
    never mixes a client figure with a server figure."""
    chosen = {}
    for metric, server in SERVER_FIGURES.items():
        client = all(s.measured(metric) for s in sides)
        traced = all(s.measured(server) for s in sides)
        if (
            metric == "tpot_ms"
            and traced
            and any(s.one_chunk_share() > ONE_CHUNK_TOLERANCE for s in sides)
        ):
            client = False
        chosen[metric] = SERVER if traced and not client else CLIENT
    return chosen


def _spread_totals(data: Mapping[str, np.ndarray], column: str, count: int) -> Floats:
    """One column's per-window totals from `sql.SLICE_WINDOW_TOTALS`' changes at the edges."""
    rows = np.asarray(data["col"]) == column
    edge: NDArray[np.int64] = np.asarray(data["k"], dtype=np.int64)[rows]

    def running(name: str) -> Floats:
        changes = np.bincount(edge, weights=_floats(data[name])[rows], minlength=count + 1)
        return np.cumsum(changes[: count + 1])

    done = running("ended") + np.arange(count + 1) * running("rate") - running("rate_start")
    return np.maximum(np.diff(done), 0.0)
