"""The GPU during a slice: mean power, GPU utilisation, memory used, and energy per output token
and per request, from the samples the collector stored under dcgm-exporter's names (NVML read by
the sidecar, or a dcgm-exporter target: `collector/gpu.py`).

Which samples: those of the slice's run, of the server sessions that served its requests, or
of no session (several servers on one GPU), stamped in the slice's throughput window — from the
first request's start to the last completion, the window throughput is measured over. A
physical GPU is one series (`gpu`/`UUID` labels); MIG instances' own rows (`GPU_I_ID`) are left
out of the totals, since NVML measures power and energy per physical GPU only.

Energy per window: the cumulative energy counter (`DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION`, mJ)
read at each window edge by linear interpolation between its samples, summed over the GPUs;
without a counter, power integrated over time (trapezoids) — `energy_basis` says which. J per
output token = Σ energy ÷ Σ output tokens over the throughput windows (1 s, or 1/20 of a
shorter run). Its interval, like throughput's, resamples those windows (a block bootstrap),
each window's energy drawn with its own tokens (`bootstrap.ratio_draws`); mean power is energy
÷ duration with the windows resampled as for throughput; utilisation is the mean of the
windows' mean readings, resampled the same way.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import duckdb
import numpy as np

from servescope.reports import sql
from servescope.reports.bootstrap import Draws, Floats, ratio_draws, total_draws
from servescope.reports.document import GpuFigures, ReplicaEnergy
from servescope.reports.sql import SliceParams

POWER = "DCGM_FI_DEV_POWER_USAGE"
ENERGY = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"
FB_USED = "DCGM_FI_DEV_FB_USED"
GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
NAMES = (POWER, ENERGY, FB_USED, GPU_UTIL)
EDGE_S = 30.0  # samples this far outside the window still anchor the interpolation at its edges


@dataclass(frozen=True)
class Window:
    """The slice's throughput windows: `count` windows of `width` s from `t0` (epoch s)."""

    t0: float
    width: float
    count: int

    @property
    def edges(self) -> Floats:
        return self.t0 + self.width * np.arange(self.count + 1, dtype=np.float64)


Series = dict[tuple[str, str], tuple[Floats, Floats]]  # (target, gpu) → (times, values)


def _series(rows: list[tuple[Any, ...]], name: str) -> Series:
    """Samples of one name per physical GPU (MIG instances' rows left out)."""
    by: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for t, target, sample_name, labels, value in rows:
        if sample_name != name:
            continue
        tags = json.loads(labels) if isinstance(labels, str) else dict(labels or {})
        if tags.get("GPU_I_ID"):
            continue
        gpu = str(tags.get("UUID") or tags.get("gpu") or "")
        by.setdefault((str(target), gpu), []).append((float(t), float(value)))
    out: Series = {}
    for key, points in by.items():
        arr = np.array(sorted(points), dtype=np.float64)
        out[key] = (arr[:, 0], arr[:, 1])
    return out


def device_names(rows: list[tuple[Any, ...]]) -> list[str]:
    """The GPUs' product names as the samples label them (dcgm-exporter's `modelName`; the
    collector's NVML rows carry the same label), each once."""
    names: set[str] = set()
    for _t, _target, _name, labels, _value in rows:
        tags = json.loads(labels) if isinstance(labels, str) else dict(labels or {})
        if tags.get("modelName"):
            names.add(str(tags["modelName"]))
    return sorted(names)


def _counter_at(times: Floats, values: Floats, edges: Floats) -> Floats | None:
    """The counter at each edge, interpolated; None unless samples bracket the window."""
    if len(times) < 2 or times[0] > edges[0] or times[-1] < edges[-1]:
        return None
    return np.interp(edges, times, values)


def _integral_at(times: Floats, values: Floats, edges: Floats) -> Floats | None:
    """∫ power dt from the first edge to each edge (J), trapezoids over the samples."""
    if len(times) < 2 or times[0] > edges[0] or times[-1] < edges[-1]:
        return None
    grid = np.union1d(times, edges)
    power = np.interp(grid, times, values)
    cumulative = np.concatenate([[0.0], np.cumsum(np.diff(grid) * (power[1:] + power[:-1]) / 2)])
    return np.interp(edges, grid, cumulative)


def window_energy(rows: list[tuple[Any, ...]], window: Window) -> tuple[Floats | None, str | None]:
    """Energy (J) used by all GPUs in each window, and its basis; (None, None) without
    samples that cover the window."""
    edges = window.edges
    counters = _series(rows, ENERGY)
    total = np.zeros(window.count, dtype=np.float64)
    if counters:
        ok = True
        for times, values in counters.values():
            at = _counter_at(times, values, edges)
            if at is None:
                ok = False
                break
            total += np.diff(at) / 1000.0  # mJ → J
        if ok:
            return total, "energy counter"
    powers = _series(rows, POWER)
    if not powers:
        return None, None
    total = np.zeros(window.count, dtype=np.float64)
    for times, values in powers.values():
        at = _integral_at(times, values, edges)
        if at is None:
            return None, None
        total += np.diff(at)
    return total, "power integrated over time"


def _window_means(rows: list[tuple[Any, ...]], name: str, window: Window) -> Floats | None:
    """Each window's mean reading (averaged over GPUs), windows without a reading left out."""
    series = _series(rows, name)
    if not series:
        return None
    sums = np.zeros(window.count)
    counts = np.zeros(window.count)
    for times, values in series.values():
        inside = (times >= window.t0) & (times < window.t0 + window.width * window.count)
        which = ((times[inside] - window.t0) // window.width).astype(np.int64)
        sums += np.bincount(which, weights=values[inside], minlength=window.count)
        counts += np.bincount(which, minlength=window.count)
    kept = counts > 0
    return sums[kept] / counts[kept] if kept.any() else None


def _mean_draws(values: Floats) -> Draws | None:
    return total_draws(values, 1.0 / len(values)) if len(values) else None


def gpu_numbers(
    con: duckdb.DuckDBPyConnection,
    run_id: str,
    window: Window | None,
    totals: Callable[[], tuple[Floats | None, Floats | None]],
) -> tuple[GpuFigures, dict[str, Draws | None]]:
    """The slice's GPU figures for the report and the bootstrap draws of those a diff tests.
    `totals`: the slice's per-window output tokens and successful requests (by completion),
    asked for only when the slice has GPU samples."""
    params = {"power": POWER, "energy": ENERGY, "fb_used": FB_USED, "gpu_util": GPU_UTIL}
    none = GpuFigures(measured=False, gpus=0)
    if window is None:
        return none, {}
    rows = con.execute(
        sql.GPU_SAMPLES,
        {
            **params,
            "run_id": run_id,
            "lo": window.t0 - EDGE_S,
            "hi": window.t0 + window.width * window.count + EDGE_S,
        },
    ).fetchall()
    if not rows:
        return none, {}
    seconds = window.width * window.count
    energy, basis = window_energy(rows, window)
    util = _window_means(rows, GPU_UTIL, window)
    power = _window_means(rows, POWER, window)
    fb = _window_means(rows, FB_USED, window)
    gpus = sorted({key[1] for key in (_series(rows, POWER) | _series(rows, ENERGY))})
    out = GpuFigures(
        measured=True,
        gpus=len(gpus),
        gpu_ids=gpus,
        devices=device_names(rows),
        energy_basis=basis,
        energy_j=float(energy.sum()) if energy is not None else None,
        mean_power_w=float(energy.sum() / seconds) if energy is not None else None,
        sampled_power_w=float(power.mean()) if power is not None else None,
        gpu_util_pct=float(util.mean()) if util is not None else None,
        fb_used_mib_peak=float(fb.max()) if fb is not None else None,
        j_per_output_token=None,
        j_per_request=None,
    )
    draws: dict[str, Draws | None] = {"gpu.gpu_util_pct": _mean_draws(util) if util is not None
                                      else None}  # fmt: skip
    if energy is not None:
        output_tokens, ok_requests = totals()
        draws["gpu.mean_power_w"] = total_draws(energy, 1.0 / seconds)
        if output_tokens is not None and output_tokens.sum() > 0:
            out["j_per_output_token"] = float(energy.sum() / output_tokens.sum())
            draws["gpu.j_per_output_token"] = ratio_draws(energy, output_tokens)
        if ok_requests is not None and ok_requests.sum() > 0:
            out["j_per_request"] = float(energy.sum() / ok_requests.sum())
            draws["gpu.j_per_request"] = ratio_draws(energy, ok_requests)
    return out, draws


def replica_energy(
    con: duckdb.DuckDBPyConnection, params: SliceParams, urls: dict[str, str]
) -> dict[str, ReplicaEnergy]:
    """Per replica of a fleet slice (`params`: the slice's run and window): the energy of the
    GPUs its server session(s) used alone, over the slice's span (the first request's start
    to the last completion, the same for every replica), per output token and per successful
    request it served. A replica's sessions are those its events name (`vllm_session`), else
    the sessions whose target is its URL (`urls`, the run's notes). Samples no session owns (a
    GPU two replicas share) are no replica's: such a replica has `measured: false` and the
    run's own figure holds that GPU's energy."""
    rows = con.execute(sql.REPLICA_SESSIONS, params).fetchall()
    if not rows:
        return {}
    first = min((r[4] for r in rows if r[4] is not None), default=None)
    last = max((r[5] for r in rows if r[5] is not None), default=None)
    if first is None or last is None or last <= first:
        return {}
    window = Window(float(first), float(last) - float(first), 1)
    names = {"power": POWER, "energy": ENERGY, "fb_used": FB_USED, "gpu_util": GPU_UTIL}
    out: dict[str, ReplicaEnergy] = {}
    for replica, sessions, ok, output_tokens, _first, _last in rows:
        runs = [s for s in sessions or [] if s]
        if not runs and urls.get(replica):
            found = con.execute(
                sql.SESSIONS_AT_TARGET,
                {"target": urls[replica], "lo": float(first), "hi": float(last)},
            ).fetchall()
            runs = [r[0] for r in found]
        samples = (
            con.execute(
                sql.GPU_SAMPLES_OF_RUNS,
                {**names, "runs": runs, "lo": first - EDGE_S, "hi": last + EDGE_S},
            ).fetchall()
            if runs
            else []
        )
        energy, basis = window_energy(samples, window) if samples else (None, None)
        if energy is None:
            out[replica] = ReplicaEnergy(measured=False, sessions=runs)
            continue
        joules = float(energy.sum())
        gpus = sorted({key[1] for key in (_series(samples, POWER) | _series(samples, ENERGY))})
        out[replica] = ReplicaEnergy(
            measured=True,
            sessions=runs,
            gpus=len(gpus),
            gpu_ids=gpus,
            energy_basis=basis,
            energy_j=joules,
            mean_power_w=joules / window.width,
            j_per_output_token=joules / output_tokens if output_tokens else None,
            j_per_request=joules / ok if ok else None,
        )
    return out
