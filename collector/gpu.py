"""GPU telemetry for the sidecar: NVML read in-process, or a dcgm-exporter `/metrics` target,
stored as `metric_samples` under dcgm-exporter's names so the two are one thing to the reports
and the dashboards.

The NVML boundary is `nvml_rows()` and nothing else: one call per field, returning plain rows
(those `benchmarks/gpu/nvml_record.py` records on a GPU server), so every step after it is
tested on records recorded from a real GPU server. NVML has no per-instance power or energy on
MIG: those stay the physical GPU's; memory used is read per MIG instance too (label
`GPU_I_ID`, as dcgm-exporter does).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NotRequired, Protocol, TypedDict, cast
from urllib.parse import urlparse

import psutil

from servescope.store.clock import utc_from_epoch, utcnow
from servescope.wire.exposition import Sample, parse_exposition

log = logging.getLogger("servescope.collector")

# dcgm-exporter's field names, with NVML's units converted to theirs.
POWER = "DCGM_FI_DEV_POWER_USAGE"  # W
ENERGY = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"  # mJ since the driver loaded
FB_USED = "DCGM_FI_DEV_FB_USED"  # MiB
GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"  # %
MEM_COPY_UTIL = "DCGM_FI_DEV_MEM_COPY_UTIL"  # %
SM_CLOCK = "DCGM_FI_DEV_SM_CLOCK"  # MHz
NAMES = (POWER, ENERGY, FB_USED, GPU_UTIL, MEM_COPY_UTIL, SM_CLOCK)
NVML_TARGET = "nvml"
MIB = 1 << 20


class NoGpu(Exception):
    """NVML cannot be loaded or sees no GPU: the reason, in one line."""


def nvml_open() -> int:
    """Initialise NVML; the number of GPUs it sees. Raises NoGpu with the reason."""
    try:
        import pynvml
    except ImportError:
        raise NoGpu("nvidia-ml-py is not installed") from None
    try:
        pynvml.nvmlInit()
        count = int(pynvml.nvmlDeviceGetCount())
    except pynvml.NVMLError as exc:
        raise NoGpu(f"NVML: {exc}") from None
    if count == 0:
        raise NoGpu("NVML sees no GPU")
    return count


class NvmlProcess(TypedDict):
    """A process computing on a GPU, as NVML lists it."""

    pid: int
    used_bytes: NotRequired[int]  # when NVML knows it


class MigRow(TypedDict, total=False):
    """A MIG instance of a GPU: its GPU instance id, UUID and framebuffer in use."""

    gi_id: int
    uuid: str
    fb_used_bytes: int


class NvmlRow(TypedDict, total=False):
    """One GPU's reading as `nvml_rows` gives it (and benchmarks/gpu/nvml_record.py records it):
    a field the GPU does not support is left out."""

    ts: float  # Unix seconds
    gpu: int  # NVML's index
    uuid: str
    name: str
    power_mw: int
    energy_mj: int  # since the driver loaded
    fb_used_bytes: int
    fb_total_bytes: int
    gpu_util_pct: int
    mem_util_pct: int
    sm_clock_mhz: int
    processes: list[NvmlProcess] | None  # None: NVML cannot list them
    mig: list[MigRow]


def nvml_rows() -> list[NvmlRow]:
    """One reading of every GPU NVML sees (those of `CUDA_VISIBLE_DEVICES` when set), one plain
    row per GPU — the rows `benchmarks/gpu/nvml_record.py` records on a GPU server — with its
    MIG instances' memory under `mig` and the processes computing on it under `processes`
    (`pid`, `used_bytes`: what the collector matches to a server's processes). A field the GPU
    does not support is left out. The only code here that touches a GPU."""
    import pynvml

    def read(call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except pynvml.NVMLError:
            return None

    now = time.time()
    rows = []
    wanted = visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"))
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        uuid = _text(read(pynvml.nvmlDeviceGetUUID, handle))
        if wanted is not None and not wanted(index, uuid):
            continue
        util = read(pynvml.nvmlDeviceGetUtilizationRates, handle)
        memory = read(pynvml.nvmlDeviceGetMemoryInfo, handle)
        row: dict[str, object] = {
            "ts": now,
            "gpu": index,
            "uuid": uuid,
            "name": _text(read(pynvml.nvmlDeviceGetName, handle)),
            "power_mw": read(pynvml.nvmlDeviceGetPowerUsage, handle),
            "energy_mj": read(pynvml.nvmlDeviceGetTotalEnergyConsumption, handle),
            "fb_used_bytes": memory.used if memory is not None else None,
            "fb_total_bytes": memory.total if memory is not None else None,
            "gpu_util_pct": util.gpu if util is not None else None,
            "mem_util_pct": util.memory if util is not None else None,
            "sm_clock_mhz": read(pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_SM),
            "processes": _processes(read(pynvml.nvmlDeviceGetComputeRunningProcesses, handle)),
        }
        mode = read(pynvml.nvmlDeviceGetMigMode, handle)
        if mode is not None and mode[0] == pynvml.NVML_DEVICE_MIG_ENABLE:
            migs = []
            for slot in range(read(pynvml.nvmlDeviceGetMaxMigDeviceCount, handle) or 0):
                mig = read(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, slot)
                if mig is None:
                    continue
                used = read(pynvml.nvmlDeviceGetMemoryInfo, mig)
                migs.append({
                    "gi_id": read(pynvml.nvmlDeviceGetGpuInstanceId, mig),
                    "uuid": _text(read(pynvml.nvmlDeviceGetUUID, mig)),
                    "fb_used_bytes": used.used if used is not None else None,
                })  # fmt: skip
            row["mig"] = migs
        # NVML's answers under NvmlRow's keys, the unsupported ones (None) left out
        rows.append(cast(NvmlRow, {k: v for k, v in row.items() if v is not None}))
    return rows


def _processes(found: Any) -> list[NvmlProcess] | None:
    """NVML's compute processes on a GPU as plain rows (`pid`, `used_bytes` when NVML knows it);
    None when NVML cannot list them, which is not the same as a GPU nobody uses (`[]`)."""
    if found is None:
        return None
    rows = []
    for proc in found:
        row: NvmlProcess = {"pid": int(proc.pid)}
        if getattr(proc, "usedGpuMemory", None) is not None:
            row["used_bytes"] = int(proc.usedGpuMemory)
        rows.append(row)
    return rows


def visible_devices(value: str | None) -> Callable[[int, str | None], bool] | None:
    """Which GPUs a `CUDA_VISIBLE_DEVICES` value names (indices or `GPU-…` UUIDs), as a test of
    (index, UUID); None when it names none in particular (unset, or MIG instances, whose
    power and energy are their GPU's anyway)."""
    if not value or not value.strip():
        return None
    names = [v.strip() for v in value.split(",") if v.strip()]
    if any(n.startswith("MIG-") for n in names):
        return None
    return lambda index, uuid: str(index) in names or (uuid is not None and uuid in names)


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


def samples_of(row: NvmlRow, run_id: str | None = None) -> list[Sample]:
    """One GPU's NVML row as dcgm-exporter would have exposed it: (ts, target, name, labels,
    run_id, value) rows, labels `gpu`, `UUID`, `modelName` (and `GPU_I_ID` per MIG instance)."""
    ts = utc_from_epoch(float(row["ts"]))
    labels = {"gpu": str(row.get("gpu", "")), "UUID": str(row.get("uuid", ""))}
    if row.get("name"):
        labels["modelName"] = str(row["name"])
    values = {
        POWER: _scaled(row.get("power_mw"), 1e-3),
        ENERGY: _scaled(row.get("energy_mj"), 1.0),
        FB_USED: _scaled(row.get("fb_used_bytes"), 1 / MIB),
        GPU_UTIL: _scaled(row.get("gpu_util_pct"), 1.0),
        MEM_COPY_UTIL: _scaled(row.get("mem_util_pct"), 1.0),
        SM_CLOCK: _scaled(row.get("sm_clock_mhz"), 1.0),
    }
    out: list[Sample] = [
        (ts, NVML_TARGET, name, labels, run_id, v) for name, v in values.items() if v is not None
    ]
    for mig in row.get("mig") or []:
        used = _scaled(mig.get("fb_used_bytes"), 1 / MIB)
        if used is not None:
            mig_labels = {**labels, "GPU_I_ID": str(mig.get("gi_id", ""))}
            out.append((ts, NVML_TARGET, FB_USED, mig_labels, run_id, used))
    return out


def _scaled(value: Any, factor: float) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) * factor


def dcgm_samples(text: str, *, url: str, ts: datetime, run_id: str | None = None) -> list[Sample]:
    """The GPU samples of a dcgm-exporter `/metrics` page (its own names and labels; the
    other families it exports are left out). Raises ValueError on text that is not
    exposition format. The client library's parser names a counter's sample `…_total`; the
    energy counter keeps dcgm-exporter's own name, as Prometheus stores it."""
    out: list[Sample] = []
    for ts_, target, name, labels, run, value in parse_exposition(
        text, target=url, ts=ts, run_id=run_id
    ):
        name = name if name in NAMES else name.removesuffix("_total")
        if name in NAMES:
            out.append((ts_, target, name, labels, run, value))
    return out


@dataclass(frozen=True)
class Reading:
    """One GPU's samples of one read, with what says whose they are: the GPU (`gpu` index and
    `UUID`, as labelled) and the pids NVML saw computing on it (None: not known, as from a
    dcgm-exporter page or where NVML cannot list processes)."""

    index: str
    uuid: str
    processes: frozenset[int] | None
    samples: list[Sample]


def readings_of_rows(rows: list[NvmlRow]) -> list[Reading]:
    """NVML rows (one per GPU) as readings, their samples under dcgm-exporter's names."""
    out = []
    for row in rows:
        procs = row.get("processes")
        pids = frozenset(int(p["pid"]) for p in procs) if isinstance(procs, list) else None
        out.append(
            Reading(str(row.get("gpu", "")), str(row.get("uuid", "")), pids, samples_of(row))
        )
    return out


def readings_of_samples(samples: list[Sample]) -> list[Reading]:
    """A dcgm-exporter page's samples grouped per physical GPU (a MIG instance's rows go with
    their GPU's)."""
    by: dict[tuple[str, str], list[Sample]] = {}
    for sample in samples:
        labels = sample[3]
        by.setdefault((str(labels.get("gpu", "")), str(labels.get("UUID", ""))), []).append(sample)
    return [Reading(index, uuid, None, group) for (index, uuid), group in by.items()]


def gpu_filter(value: str) -> Callable[[str, str], bool]:
    """`collect --gpu 0,1` or `--gpu GPU-…`: a test of (index, UUID) for the GPUs named."""
    names = {v.strip() for v in value.split(",") if v.strip()}
    return lambda index, uuid: index in names or uuid in names


class Server(Protocol):
    """What attributing a GPU needs of a server session (`collector.sessions.Session`)."""

    run_id: str | None
    target: str | None


@dataclass(frozen=True)
class ServerGpus:
    """A running server as the GPU attribution sees it: its process tree (empty when it cannot
    be read) and its `CUDA_VISIBLE_DEVICES` (None when unset or unreadable)."""

    run_id: str
    target: str | None
    pids: frozenset[int] = frozenset()
    visible: str | None = None


LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0", "::", ""}
RETRY_S = 30.0  # a server whose process was not found is looked for again this often


class ServerProcesses:
    """Finds a server session's processes on this host: the process listening on its port
    (a vLLM API server), and everything it started (engine cores, tensor-parallel workers),
    which are the processes NVML sees on the GPUs. A server on another host, in another PID
    namespace or of another user is not found: it is then matched by `CUDA_VISIBLE_DEVICES`
    if readable, else not at all."""

    def __init__(self) -> None:
        self._root: dict[str, tuple[int | None, float]] = {}  # run id → (pid, when looked)
        self._visible: dict[int, str | None] = {}

    def of(self, server: Server) -> ServerGpus | None:
        if not server.run_id:
            return None
        pid = self._root_pid(server)
        if pid is None:
            return ServerGpus(server.run_id, server.target)
        try:
            root = psutil.Process(pid)
            pids = frozenset([pid, *(c.pid for c in root.children(recursive=True))])
        except psutil.Error:
            self._root.pop(server.run_id, None)
            return ServerGpus(server.run_id, server.target)
        if pid not in self._visible:
            try:
                self._visible[pid] = root.environ().get("CUDA_VISIBLE_DEVICES")
            except psutil.Error:
                self._visible[pid] = None
        return ServerGpus(server.run_id, server.target, pids, self._visible[pid])

    def _root_pid(self, server: Server) -> int | None:
        assert server.run_id is not None
        pid, looked = self._root.get(server.run_id, (None, float("-inf")))
        if pid is not None and psutil.pid_exists(pid):
            return pid
        if time.monotonic() - looked < RETRY_S:
            return None
        pid = listening_pid(server.target)
        self._root[server.run_id] = (pid, time.monotonic())
        return pid


def listening_pid(target: str | None) -> int | None:
    """The local process listening on a target URL's port; None for another host's URL or
    where the sockets of that process cannot be read."""
    if not target:
        return None
    parsed = urlparse(target)
    if (parsed.hostname or "") not in LOCAL_HOSTS | {socket.gethostname()} or not parsed.port:
        return None
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == parsed.port:
                return conn.pid
    except (psutil.Error, OSError):
        return None
    return None


SHARED = ""  # an owner: several servers (or another process) use the GPU; stored as no run's


def owners(readings: list[Reading], servers: list[ServerGpus]) -> list[str | None]:
    """Whose each reading is: a server's run id, `SHARED`, or None (drop it: the GPU is none of
    these servers', which are all placed; another collector or nobody measures it).

    A server's GPUs are those NVML saw its processes on; when it saw them on none (processes
    unreadable, or not on a GPU yet), those of its `CUDA_VISIBLE_DEVICES`; when neither is
    known, the server is not placed. A GPU one placed server uses is that server's, unless
    processes of no server here compute on it too (shared); a GPU several use is shared. With
    a server not placed, a GPU no placed server claims is the one running server's (one
    server a host, as before servers could be placed), else shared. Without a running server,
    every reading is stored as no run's."""
    ours = frozenset().union(*(s.pids for s in servers))
    by_process: dict[str, set[int]] = {}
    for server in servers:
        found = {
            i for i, r in enumerate(readings)
            if r.processes is not None and r.processes & server.pids
        }  # fmt: skip
        if found:
            by_process[server.run_id] = found
    placed: dict[str, set[int]] = dict(by_process)
    for server in servers:
        if server.run_id in placed or server.visible is None:
            continue
        pick = visible_devices(server.visible)
        if pick is not None:
            placed[server.run_id] = {
                i for i, r in enumerate(readings) if pick(_index(r.index), r.uuid or None)
            }
    unplaced = [s for s in servers if s.run_id not in placed]
    out: list[str | None] = []
    for i, reading in enumerate(readings):
        claims = [run for run, gpus in placed.items() if i in gpus]
        foreign = reading.processes is not None and bool(reading.processes - ours)
        if len(claims) == 1:
            mine_by_process = claims[0] in by_process
            out.append(SHARED if mine_by_process and foreign else claims[0])
        elif claims or not servers:
            out.append(SHARED)
        elif unplaced:
            out.append(servers[0].run_id if len(servers) == 1 else SHARED)
        else:
            out.append(None)
    return out


def _index(index: str) -> int:
    return int(index) if index.isdigit() else -1


@dataclass
class GpuSource:
    """Where the collector's GPU samples come from: `nvml` (this host's GPUs) or a
    dcgm-exporter URL; `only` keeps the GPUs `collect --gpu IDS` names. `read()` gives each
    GPU's samples the run of the server session that uses it (`owners`), and never raises: a
    failed read is logged and gives nothing. `nvml` is NVML's boundary, replayed from
    recordings where there is no GPU."""

    url: str | None = None  # a dcgm-exporter /metrics URL; None = NVML
    timeout: float = 5.0
    only: Callable[[str, str], bool] | None = None
    nvml: Callable[[], list[NvmlRow]] = nvml_rows
    processes: ServerProcesses = field(default_factory=ServerProcesses)
    owned: dict[tuple[str, str], str] = field(default_factory=dict)  # (gpu, UUID) → target

    @property
    def name(self) -> str:
        return self.url or NVML_TARGET

    def read(self, running: Callable[[], Sequence[Server]] = tuple) -> list[Sample]:
        """One reading of the GPUs, attributed among the server sessions `running()` gives
        once the GPUs are read; `owned` then maps each GPU one server uses to that server's
        target."""
        try:
            readings = self._read()
        except Exception as exc:  # noqa: BLE001 - NVML, a dcgm page or a driver: a GPU read must never stop the collector
            log.warning("GPU telemetry from %s failed: %s", self.name, exc)
            return []
        if self.only is not None:
            only = self.only
            readings = [r for r in readings if only(r.index, r.uuid)]
        servers = [g for g in (self.processes.of(s) for s in running()) if g is not None]
        targets = {s.run_id: s.target for s in servers}
        out: list[Sample] = []
        self.owned = {}
        for reading, owner in zip(readings, owners(readings, servers), strict=True):
            if owner is None:
                continue
            run = owner or None
            out.extend((ts, tgt, name, labels, run, v) for ts, tgt, name, labels, _r, v in
                       reading.samples)  # fmt: skip
            if run is not None and targets.get(run):
                self.owned[(reading.index, reading.uuid)] = str(targets[run])
        return out

    def _read(self) -> list[Reading]:
        if self.url is None:
            return readings_of_rows(self.nvml())
        with urllib.request.urlopen(self.url, timeout=self.timeout) as resp:
            text = resp.read().decode("utf-8", "replace")
        now = utcnow()
        return readings_of_samples(dcgm_samples(text, url=self.url, ts=now))


GPU_MODES = ("auto", "on", "off")


def open_gpu_source(mode: str, dcgm_url: str | None) -> tuple[GpuSource | None, str]:
    """The GPU source `collect` uses and the one line its log says about it. `mode`: `auto`
    (NVML when it finds a GPU), `on` (NVML must work), `off`, or the GPUs to read (indices or
    UUIDs, comma-separated: NVML must work, or the dcgm-exporter is filtered to them); a
    dcgm-exporter URL wins over NVML."""
    only = gpu_filter(mode) if mode not in GPU_MODES else None
    which = f", GPU(s) {mode}" if only is not None else ""
    if dcgm_url:
        return (
            GpuSource(url=dcgm_url, only=only),
            f"GPU telemetry: scraping dcgm-exporter at {dcgm_url}{which}",
        )
    if mode == "off":
        return None, "GPU telemetry: off"
    try:
        count = nvml_open()
    except NoGpu as exc:
        if mode != "auto":
            raise
        return None, f"GPU telemetry: no GPU ({exc})"
    return GpuSource(only=only), f"GPU telemetry: NVML, {count} GPU(s){which}"
