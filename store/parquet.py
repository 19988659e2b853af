"""Hive-partitioned Parquet export, for when the data outgrows one DuckDB file.

`OUT/events/run_id=…/date=…/*.parquet` and `OUT/runtime_events/…` are read as they are by DuckDB
(`read_parquet('OUT/events/**/*.parquet', hive_partitioning = true)`), ClickHouse and Spark;
servescope never grows its own distributed store. `date` is the UTC day of the record's `ts`
(Hive's `__HIVE_DEFAULT_PARTITION__`, read back as NULL, when a record has none). DuckDB
percent-encodes partition values, so a run id never becomes a path; one too long for a folder
name is partitioned under `store.paths.partition_value` (its head, `~`, a digest).
"""

from __future__ import annotations

from pathlib import Path

import duckdb

from servescope.store import queries, runtime
from servescope.store.db import Store, quiet
from servescope.store.paths import partition_value


def export_parquet(store: Store, out: Path, run_id: str | None = None) -> dict[str, int]:
    """Write one run (or every run) under `out`; returns the rows written per table.

    Each table's folder is replaced as a whole, so a re-export never mixes old and new files;
    nothing else under `out` is touched.
    """
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, int] = {}
    with store.read() as con:
        tables = ["events", *(["runtime_events"] if runtime.table_exists(con) else [])]
        for table in tables:
            ids = con.execute(queries.parquet_run_ids(table), {"run_id": run_id}).fetchall()
            long = {r: partition_value(r) for (r,) in ids if partition_value(r) != r}
            params = {
                "run_id": run_id,
                "out": str(out / table),
                "long": list(long),
                "short": list(long.values()),
            }
            row = con.execute(queries.parquet_copy(table), params).fetchone()
            written[table] = int(row[0]) if row else 0
    return written


def count_parquet(folder: Path) -> int:
    """Rows DuckDB reads back from one exported table folder (0 when it holds no file)."""
    if not any(folder.glob("**/*.parquet")):
        return 0
    with quiet(duckdb.connect()) as con:
        row = con.execute(
            queries.PARQUET_COUNT, {"files": str(folder / "**" / "*.parquet")}
        ).fetchone()
    return int(row[0]) if row else 0
