"""Upkeep of the lake with Delta's own tools, run in the background by each sidecar.

- **Compaction** (`OPTIMIZE`, delta-rs' bin-packing): a trickle commits a small file per
  partition per flush; every pass rewrites the small files of the partitions this sidecar wrote
  since its last pass into files of up to `TARGET_BYTES`, in one commit that removes what it
  replaced. Readers of an older version still find every file it listed (files leave only at
  VACUUM), and a reader of the new version sees each row once.
- **Expiry** (`--retain`): metric samples older than the window are deleted (a Delta DELETE).
- **VACUUM**: files that no version younger than `VACUUM_HOURS` references (replaced by
  compaction or an update, or left by a writer killed before its commit) are removed; old log
  entries go with Delta's checkpoints (`delta.logRetentionDuration`).

A pass that loses a commit race with another sidecar's (two compactions of one partition, a
MERGE into a file being compacted) is simply tried at the next pass: Delta's conflict check
keeps the table as it was.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError

from servescope.store.clock import iso, utcnow
from servescope.store.lake import LakeWriter
from servescope.store.lakelayout import (
    PARTITIONED,
    RUN_KEY,
    TABLES,
    retry_commit,
    storage_options,
    table_uri,
)

log = logging.getLogger("servescope.lake")


def _table(lake: LakeWriter, name: str) -> DeltaTable:
    """A table of its own: the writer's thread holds the writer's (`LakeWriter.table`)."""
    return DeltaTable(table_uri(lake.location, name), storage_options=storage_options())


TARGET_BYTES = 128 << 20
VACUUM_HOURS = 24  # the longest a reader may hold a version open


def compact(lake: LakeWriter) -> dict[str, int]:
    """Compact the partitions this sidecar wrote since the last pass; returns the files
    removed and added per table."""
    keys, lake.touched = sorted(lake.touched), set()
    done: dict[str, int] = {}
    if not keys:
        return done
    for table in PARTITIONED:
        try:
            metrics = _table(lake, table).optimize.compact(
                partition_filters=[(RUN_KEY, "in", keys)], target_size=TARGET_BYTES
            )
        except CommitFailedError:
            lake.touched.update(keys)  # another sidecar's commit won: the next pass
            continue
        done[table] = int(metrics.get("numFilesRemoved", 0))
    return done


def expire(lake: LakeWriter, retain: timedelta | None, now: datetime | None = None) -> int:
    """Delete metric samples older than `retain`, then VACUUM every table; returns the samples
    deleted."""
    deleted = 0
    if retain is not None:
        cutoff = iso((now or utcnow()) - retain)
        result = retry_commit(
            lambda: _table(lake, "metric_samples").delete(f"ts < '{cutoff}'"), "expiry"
        )
        deleted = int((result or {}).get("num_deleted_rows", 0))
    for table in TABLES:
        _table(lake, table).vacuum(
            retention_hours=VACUUM_HOURS, dry_run=False, enforce_retention_duration=False
        )
    return deleted
