"""The store writer: one pending batch into the store (and the lake) in one transaction.

Everything a batch holds — rows, refused input, samples, server sessions and their lever flips,
and the checkpoints that cover them — commits together or not at all; that is what makes a
restart resume exactly where the last commit ended (docs/design.md, "Collector").
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import KW_ONLY, dataclass, field
from datetime import datetime
from typing import Any

import duckdb

from servescope.collector.attribution import Attribution
from servescope.collector.batch import Batch
from servescope.collector.sessions import Session
from servescope.collector.tail import Chunk
from servescope.store import Store, bulk, checkpoints, run_id_of
from servescope.store.clock import naive_utc
from servescope.store.lake import LakeWriter, Owed


@dataclass
class FlushReport:
    """One committed flush: what it wrote, and the requests it touched (when asked for)."""

    events: int = 0
    errors: int = 0
    samples: int = 0
    flips: int = 0
    flipped: list[tuple[str, str | None, str | None, datetime]] = field(default_factory=list)
    keys: list[tuple[str, str]] = field(default_factory=list)
    lines: Counter[str] = field(default_factory=Counter)  # lines read, by source
    reasons: Counter[str] = field(default_factory=Counter)
    committed_at: float = 0.0
    lag_s: float = 0.0


def reason_class(reason: str) -> str:
    """A refusal reason without its details, as a bounded metric label."""
    return reason.split(":", 1)[0].split("(", 1)[0].strip()[:60] or "unknown"


def _json(value: Any) -> str | None:
    """A lever value in the one spelling every flip uses (JSON: `true`, `128`, `"auto"`)."""
    return None if value is None else json.dumps(value)


def _contiguous(chunks: list[tuple[str, Chunk]]) -> list[tuple[str, list[Chunk]]]:
    """Consecutive chunks of one file, grouped: one bulk statement takes each group, as DuckDB's
    parallel readers pay off on big inputs and each statement has a fixed cost."""
    groups: list[tuple[str, list[Chunk]]] = []
    for source, chunk in chunks:
        last = groups[-1][1][-1] if groups else None
        if last and last.file is chunk.file and last.start + len(last.data) == chunk.start:
            groups[-1][1].append(chunk)
        else:
            groups.append((source, [chunk]))
    return groups


@dataclass(eq=False)
class StoreWriter:
    """Commits batches. `attribution` places trace pieces in their sessions inside the
    transaction (it may look up where the log put a request); `want_keys` asks every report for
    the requests it touched (the OTLP forwarder reads them back)."""

    store: Store
    attribution: Attribution
    _: KW_ONLY
    lake: LakeWriter | None = None
    want_keys: bool = False

    def commit(self, batch: Batch) -> FlushReport:
        """The batch in one store transaction, then (after the commit) into the lake."""
        owed: Owed | None = None
        lake = self.lake
        with self.store.write() as con:
            mark = lake.mark(con) if lake is not None else None
            report = self._write(batch, con)
            if lake is not None and mark is not None:
                # what the lake gets from this flush, saved with it (store/lake.py)
                sessions = batch.sessions.values()
                groups = [(s.run_id, s.previous) for s in sessions if s.run_id and s.previous]
                owed = lake.owe(con, mark, runs=list(batch.sessions), flip_groups=groups)
        if lake is not None:
            lake.committed(owed)
        report.committed_at = time.time()
        report.lag_s = report.committed_at - (batch.oldest or report.committed_at)
        return report

    def _write(self, batch: Batch, con: duckdb.DuckDBPyConnection) -> FlushReport:
        """The batch into the store, inside the flush's transaction."""
        report = FlushReport(lines=Counter(batch.lines))
        self._write_chunks(batch.chunks, con, report)
        if batch.docs:
            self.attribution.place_pieces(batch.docs, self.store, con)
            report.events += self.store.add_events(batch.docs, con)
            if self.want_keys:
                report.keys.extend((run_id_of(d), d["request_id"]) for d in batch.docs)
        for source, offset, reason, raw in batch.errors:
            self.store.add_ingest_error(source, offset, reason, raw, con)
            report.reasons[reason_class(reason)] += 1
        report.errors = sum(report.reasons.values())
        self.store.add_metric_samples(batch.samples, con)
        report.samples = len(batch.samples)
        for session in batch.sessions.values():
            self._write_session(session, con, report)
        for source, rows in batch.checkpoints.items():
            checkpoints.save(con, source, rows.values())
        return report

    def _write_chunks(
        self, chunks: list[tuple[str, Chunk]], con: duckdb.DuckDBPyConnection, report: FlushReport
    ) -> None:
        """`.events.jsonl` lines in bulk: one statement a run of consecutive chunks of a file;
        the store's rules refuse lines into `ingest_errors` inside the statement."""
        for source, group in _contiguous(chunks):
            result = bulk.ingest_lines(
                self.store,
                con,
                [chunk.data for chunk in group],
                source=group[0].file.error_source,
                offset=group[0].start,
                want_keys=self.want_keys,
            )
            report.lines[source] += result.lines
            report.events += result.events
            report.keys.extend(result.keys)
            for _off, reason in result.errors:
                report.reasons[reason_class(reason)] += 1

    def _write_session(
        self, session: Session, con: duckdb.DuckDBPyConnection, report: FlushReport
    ) -> None:
        """A session's `runs` row, and its flips: one row per lever that differs from the
        session before it, naming both runs (written again whole when its levers change)."""
        assert session.run_id is not None
        self.store.upsert_run(session.run_id, con, **session.run_row())
        if session.previous is None or session.previous_levers is None:
            return
        ts = session.started()
        assert ts is not None
        at = naive_utc(ts)
        rows = [(lever, _json(old), _json(new)) for lever, old, new in session.flips()]
        note = f"server restarted: {session.previous} -> {session.run_id}"
        written = self.store.replace_flips(session.run_id, session.previous, rows, at, note, con)
        report.flips += written
        report.flipped.extend((lever, before, after, at) for lever, before, after in rows)
