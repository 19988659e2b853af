"""What a flush owes the shared lake (`store.lake`): where the store's tables stood when the
flush began (`Mark`), and what it committed that the lake gets (`Owed`), saved in the store with
the flush so that a crash never loses it; two unwritten flushes join into one write.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict

import duckdb
import pyarrow as pa


@dataclass
class Mark:
    """Where the store's tables stood when a flush began (inside its transaction)."""

    rowids: dict[str, int]
    events: int


class OwedState(TypedDict):
    """An `Owed` as the store keeps it (JSON: pairs come back as lists, read by `from_state`)."""

    seq: int
    after: dict[str, int]
    updated: list[tuple[str, str]]
    moved: list[tuple[str, str]]
    touched: list[str | None]
    fresh: int
    since: str | None
    runs: list[str]
    flips: list[tuple[str, str]]


@dataclass
class Owed:
    """What flush `seq` committed to the store and the lake gets from it.

    Its `events` rows are taken inside its transaction (`held`): DuckDB may renumber rowids
    when it checkpoints a table whose rows were deleted (a request moved to another run, an
    update DuckDB makes as a delete and an insert), so "the rows past the start" is exact only
    there. Except a backlog's flush whose every request is new (`fresh`, their count): its rows
    are read after the commit, off the collector's path, and written at once; had a rowid moved
    meanwhile, fewer rows than `fresh` lie past the start, and its runs are merged whole. Should
    the process die before held rows are written, the next start merges every row of the runs
    the flush touched (`touched`) instead. Its updated requests (a MERGE, not an
    append) and those that left a run (deleted there) are named; `since` is a little below the
    earliest `ts` the lake's rows of them have, so the MERGE reads only files that may hold
    them. `metric_samples` and `runtime_events` only ever gain rows in a flush: the rows past
    `after`. `runs` and `flips`: the runs and restarts it changed."""

    seq: int
    after: dict[str, int]
    updated: list[tuple[str, str]] = field(default_factory=list)
    moved: list[tuple[str, str]] = field(default_factory=list)
    touched: list[str | None] = field(default_factory=list)
    fresh: int = 0
    since: str | None = None
    runs: list[str] = field(default_factory=list)
    flips: list[tuple[str, str]] = field(default_factory=list)
    held: pa.Table | None = field(default=None, repr=False, compare=False)

    def state(self) -> OwedState:
        """What the store keeps (not the rows held in memory)."""
        return OwedState(
            seq=self.seq, after=self.after, updated=self.updated, moved=self.moved,
            touched=self.touched, fresh=self.fresh, since=self.since, runs=self.runs,
            flips=self.flips,
        )  # fmt: skip

    def then(self, later: Owed) -> Owed:
        """This unwritten flush and a later one as one write: the later flush's rows win where
        both hold a request, and a request the later one moved away is only a deletion."""
        gone = set(later.moved)
        if self.held is not None and later.held is not None:
            held: pa.Table | None = _latest(pa.concat_tables([self.held, later.held]), gone)
        elif self.held is None and not self.touched and not later.fresh:
            held = later.held
        elif later.held is None and not later.touched and self.held is not None and not self.fresh:
            held = _latest(self.held, gone)
        else:  # a flush whose rows were not taken (adopted from the store): its runs whole
            held = None
        times = [o.since for o in (self, later) if o.updated or o.moved]
        return Owed(
            seq=later.seq,
            after=self.after,
            updated=sorted((set(self.updated) | set(later.updated)) - gone),
            moved=sorted(set(self.moved) | gone),
            touched=sorted(set(self.touched) | set(later.touched), key=str),
            since=None if None in times else min(times, default=None),  # type: ignore[type-var]
            runs=sorted(set(self.runs) | set(later.runs)),
            flips=sorted(set(self.flips) | set(later.flips)),
            held=held,
        )

    @property
    def rows(self) -> int:
        return self.held.num_rows if self.held is not None else 0

    @classmethod
    def from_state(cls, state: OwedState) -> Owed:
        return cls(
            seq=int(state["seq"]),
            after={k: int(v) for k, v in state.get("after", {}).items()},
            updated=[(str(r), str(q)) for r, q in state.get("updated", [])],
            moved=[(str(r), str(q)) for r, q in state.get("moved", [])],
            touched=list(state.get("touched", [])),
            fresh=int(state.get("fresh") or 0),
            since=state.get("since"),
            runs=[str(r) for r in state.get("runs", [])],
            flips=[(str(r), str(b)) for r, b in state.get("flips", [])],
        )


def _latest(rows: pa.Table, gone: set[tuple[str, str]]) -> pa.Table:
    """One row per request, the last one, none of the requests in `gone`."""
    order = pa.array(range(rows.num_rows), pa.int64())
    last = (
        rows.select(["run_id", "request_id"]).append_column("lake_order", order)
        .group_by(["run_id", "request_id"]).aggregate([("lake_order", "max")])
    )  # fmt: skip
    keys = zip(last.column("run_id").to_pylist(), last.column("request_id").to_pylist(),
               strict=True)  # fmt: skip
    keep = [int(k) for k, key in zip(last.column("lake_order_max").to_pylist(), keys, strict=True)
            if key not in gone and k is not None]  # fmt: skip
    return rows.take(pa.array(sorted(keep), pa.int64()))


def changed_flips(
    con: duckdb.DuckDBPyConnection, mark: Mark, groups: list[tuple[str, str]]
) -> list[tuple[str, str]]:
    """The restarts (run, previous run) whose set of flips this transaction changed."""
    if not groups:
        return []
    params = [[g[0] for g in groups], [g[1] for g in groups]]
    after = int(mark.rowids.get("lever_flips", -1))
    since = _FLIP_GROUPS + f" AND rowid > {after}"
    changed = {tuple(r) for r in con.execute(since, params).fetchall()}
    now = {tuple(r) for r in con.execute(_FLIP_GROUPS, params).fetchall()}
    with con.cursor() as before:  # the store as it was before this flush
        had = {tuple(r) for r in before.execute(_FLIP_GROUPS, params).fetchall()}
    return sorted((str(r), str(b)) for r, b in changed | (had - now))


_FLIP_GROUPS = """
SELECT DISTINCT run_id, before_run_id FROM lever_flips
WHERE (run_id, before_run_id) IN (SELECT unnest($1::VARCHAR[]), unnest($2::VARCHAR[]))
"""
