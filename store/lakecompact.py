"""Compaction of one sidecar's small lake files, run in the background by its collector.

A flush writes one small file per partition it touches (a trickle flushes every 0.25 s), so a
partition gathers many parts. A pass merges runs of consecutive small files of *this* sidecar
(never another's: no two compactors ever touch one file) whose flushes the store has committed
into one `merged-<sidecar>-<lo>-<hi>.parquet`, written aside and renamed in. The merged file
covers every file of the sidecar in that partition whose flushes lie in [lo, hi]: a reader
listing the partition (`store.lake.list_files`) skips covered files from the moment the merged
file appears, so it never sees a row twice; covered files are deleted only `grace_s` after the
merged file appeared, so a reader that listed the partition just before still finds every file
it listed. Engines that glob the folder themselves (ClickHouse, Spark) may see a row twice
within that grace: the lake's one rule (the greatest `lake_version` per request wins, see
store/lake.py) makes the copies one.

Rows are copied as they are (no version is resolved here): every rule readers apply holds for
the merged file as it held for its parts.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import duckdb

from servescope.store.db import quiet
from servescope.store.lake import (
    STAGING,
    TABLES,
    LakeFile,
    files_in,
    merged_name,
    sql_literal,
    subdirs,
    visible,
)

MIN_FILES = 8  # merge once a partition holds this many small files of the sidecar
SMALL_BYTES = 32 << 20  # a file this large is left as it is
MAX_MERGE_BYTES = 256 << 20  # one merged file takes at most this much input
GRACE_S = 600.0  # covered files outlive their merged file's arrival by this long


@dataclass
class CompactionReport:
    merged: int = 0  # merged files written
    parts: int = 0  # files they cover
    removed: int = 0  # covered files deleted after the grace


def compact(
    root: Path,
    sidecar: str,
    committed: int,
    *,
    min_files: int = MIN_FILES,
    grace_s: float = GRACE_S,
) -> CompactionReport:
    """One pass over the lake for `sidecar`'s files of flushes up to `committed`."""
    report = CompactionReport()
    staging = root / STAGING / sidecar / "compact"
    with quiet(duckdb.connect()) as con:
        con.execute("SET memory_limit = '512MB'")
        con.execute("SET preserve_insertion_order = true")
        for table in TABLES:
            for folder in subdirs(root / table):
                for partition in subdirs(folder):
                    mine = [f for f in files_in(partition, table) if f.sidecar == sidecar]
                    if not mine:
                        continue
                    report.removed += _remove_covered(mine, grace_s)
                    for group in _groups(visible(mine), committed, min_files):
                        _merge(con, group, partition, sidecar, staging)
                        report.merged += 1
                        report.parts += len(group)
    shutil.rmtree(staging, ignore_errors=True)
    return report


def _size(f: LakeFile) -> int:
    try:
        return f.path.stat().st_size
    except FileNotFoundError:
        return SMALL_BYTES  # gone meanwhile: never merged


def _groups(files: list[LakeFile], committed: int, min_files: int) -> list[list[LakeFile]]:
    """Runs of consecutive (by flush) small committed files, each worth a merge: a merged
    file's range must not take in a file it does not hold."""
    groups: list[list[LakeFile]] = []
    current: list[LakeFile] = []
    total = 0
    for f in sorted(files, key=lambda f: (f.lo, f.hi, f.path.name)):
        size = _size(f)
        fits = f.hi <= committed and size < SMALL_BYTES and total + size <= MAX_MERGE_BYTES
        if not fits:
            if len(current) >= min_files:
                groups.append(current)
            current, total = [], 0
            if f.hi <= committed and size < SMALL_BYTES:  # only the byte cap broke the run
                current, total = [f], size
            continue
        current.append(f)
        total += size
    if len(current) >= min_files:
        groups.append(current)
    return groups


def _merge(
    con: duckdb.DuckDBPyConnection,
    group: list[LakeFile],
    partition: Path,
    sidecar: str,
    staging: Path,
) -> None:
    lo = min(f.lo for f in group)
    hi = max(f.hi for f in group)
    staging.mkdir(parents=True, exist_ok=True)
    tmp = staging / f"{uuid.uuid4().hex}.parquet"
    files = "[" + ", ".join(f"'{sql_literal(f.path)}'" for f in group) + "]"
    options = "hive_partitioning = false, union_by_name = true"  # the files' own columns
    con.execute(
        f"COPY (SELECT * FROM read_parquet({files}, {options})) "  # noqa: S608
        f"TO '{sql_literal(tmp)}' (FORMAT parquet, COMPRESSION zstd)"
    )
    target = partition / merged_name(sidecar, lo, hi)
    os.replace(tmp, target)


def _remove_covered(files: list[LakeFile], grace_s: float) -> int:
    """Delete files a merged file has covered for longer than the grace."""
    now = time.time()
    shown = {f.path for f in visible(files)}
    removed = 0
    for f in files:
        if f.path in shown:
            continue
        covers = [
            m for m in files
            if m.merged and m is not f and m.lo <= f.lo and f.hi <= m.hi
            and (m.lo, m.hi) != (f.lo, f.hi)
        ]  # fmt: skip
        try:
            old_enough = any(now - m.path.stat().st_mtime >= grace_s for m in covers)
        except FileNotFoundError:
            continue
        if old_enough:
            f.path.unlink(missing_ok=True)
            removed += 1
    return removed
