"""The event schema: one SQLModel class per table of the store.

These classes are the single definition of the tables; `store.tables` derives from them the DDL,
the column lists and types, and the columns an older store gains when it is opened.
Rows are written and read with plain DuckDB SQL (see `store.queries`), because bulk ingestion
through an ORM session would be orders of magnitude slower than DuckDB's own inserts.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Column, DateTime, Double, Text
from sqlalchemy.types import ARRAY, UserDefinedType
from sqlmodel import Field, SQLModel


class CompressedText(UserDefinedType[str]):
    """Text kept with zstd and no per-block choice of compression: a record's `doc` is written
    once, read back whole (export, joins by key), and DuckDB's sampling of every compression
    for it costs a fifth of a bulk insert. Holds JSON; DuckDB's JSON functions read it as is."""

    cache_ok = True

    def get_col_spec(self, **_kw: Any) -> str:  # SQLAlchemy passes the dialect's options
        return "VARCHAR USING COMPRESSION zstd"


class Event(SQLModel, table=True):
    """One request, as seen by the client, the gateway, vLLM's trace and vLLM's log, merged.

    `doc` holds the event exactly as it is exported to `.events.jsonl` (unknown keys included,
    original key order and number types kept); the typed columns are projections of it for SQL.

    `(run_id, request_id)` identifies a row, but the table has no key index: the store's writers
    keep it unique themselves (`Store.add_events` replaces the rows it merges, `store.bulk` inserts
    only requests not stored yet). An index would cost more than the rest of a bulk insert, and
    DuckDB rewrites it at every checkpoint, i.e. at every collector flush.
    """

    __tablename__ = "events"
    __mapper_args__ = {"primary_key": ["run_id", "request_id"]}  # the ORM's identity, no index

    run_id: str
    request_id: str
    source: str | None = None
    ts: datetime | None = Field(default=None, sa_column=Column(DateTime(timezone=False)))
    model: str | None = None
    team: str | None = None
    workload: str | None = None
    concurrency: int | None = None
    target_rate: float | None = Field(default=None, sa_column=Column(Double))
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    cache_hit: bool | None = None
    ttft_ms: float | None = Field(default=None, sa_column=Column(Double))
    tpot_ms: float | None = Field(default=None, sa_column=Column(Double))
    e2e_ms: float | None = Field(default=None, sa_column=Column(Double))
    itl_ms: list[float] | None = Field(default=None, sa_column=Column(ARRAY(Double)))
    queue_ms: float | None = Field(default=None, sa_column=Column(Double))
    prefill_ms: float | None = Field(default=None, sa_column=Column(Double))
    decode_ms: float | None = Field(default=None, sa_column=Column(Double))
    finish_reason: str | None = None
    status: str | None = None
    http_status: int | None = None
    error: str | None = None
    trace_id: str | None = None
    doc: dict[str, Any] = Field(sa_column=Column(CompressedText, nullable=False))
    # vLLM's own timings from its trace (`gen_ai.latency.*`), next to the client's; last, so a
    # store made before them gains them with ALTER TABLE … ADD COLUMN
    server_ttft_ms: float | None = Field(default=None, sa_column=Column(Double))
    server_e2e_ms: float | None = Field(default=None, sa_column=Column(Double))
    vllm_session: str | None = None  # the server session's run that served the request
    # the failure's own words (a gateway keeps the server's error body), read by the checks for
    # out-of-memory failures without touching `doc`
    error_detail: str | None = None
    # vLLM's TPOT of a request served in parts (the mean of its samples'; NULL otherwise: a
    # report derives it from decode_ms), a column so a report never touches `doc` for it
    server_tpot_ms: float | None = Field(default=None, sa_column=Column(Double))


class Run(SQLModel, table=True):
    """A benchmark run or any other named group of requests (`run-YYYYMMDD[-label]`)."""

    __tablename__ = "runs"

    run_id: str = Field(primary_key=True)
    started_at: datetime | None = Field(default=None, sa_column=Column(DateTime(timezone=False)))
    ended_at: datetime | None = Field(default=None, sa_column=Column(DateTime(timezone=False)))
    label: str | None = None
    target: str | None = None
    model: str | None = None
    vllm_version: str | None = None
    levers: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    workload: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    status: str | None = None
    notes: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))


class MetricSample(SQLModel, table=True):
    """One sample of one series scraped from a `/metrics` endpoint (or a log stats line)."""

    __tablename__ = "metric_samples"

    ts: datetime = Field(sa_column=Column(DateTime(timezone=False), primary_key=True))
    target: str = Field(primary_key=True)
    name: str = Field(primary_key=True)
    labels: str = Field(primary_key=True, sa_column_kwargs={"server_default": "{}"})
    run_id: str | None = None
    value: float = Field(sa_column=Column(Double, nullable=False))


class LeverFlip(SQLModel, table=True):
    """A change of one server lever: what dashboards annotate and reports split on.

    All timestamps of the store are naive UTC.
    """

    __tablename__ = "lever_flips"

    ts: datetime = Field(sa_column=Column(DateTime(timezone=False), primary_key=True))
    lever: str = Field(primary_key=True)
    run_id: str | None = None
    before: str | None = None
    after: str | None = None
    note: str | None = None
    before_run_id: str | None = None  # a restart's flip: the server session it came from


class IngestError(SQLModel, table=True):
    """A line that could not be ingested, kept verbatim with the reason."""

    __tablename__ = "ingest_errors"

    source: str = Field(primary_key=True)
    offset: int = Field(sa_column=Column(BigInteger, primary_key=True))
    ts: datetime | None = Field(default=None, sa_column=Column(DateTime(timezone=False)))
    reason: str
    raw: str | None = Field(default=None, sa_column=Column(Text))


class RuntimeEvent(SQLModel, table=True):
    """An agent-runtime line of an `.events.jsonl` file (tool call, approval, test result…).

    `doc` is the line as it came; `after_request_id` is the request record that preceded it in
    its run, so export puts it back in place. Joins to `events` by request_id or trace_id.
    """

    __tablename__ = "runtime_events"

    run_id: str = Field(primary_key=True)
    event_id: str = Field(primary_key=True)
    type: str
    ts: datetime | None = Field(default=None, sa_column=Column(DateTime(timezone=False)))
    request_id: str | None = None
    trace_id: str | None = None
    after_request_id: str | None = None
    ingested_at: datetime = Field(sa_column=Column(DateTime(timezone=False), nullable=False))
    seq: int = Field(sa_column=Column(BigInteger, nullable=False))
    doc: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))


TABLES: list[type[SQLModel]] = [Event, Run, MetricSample, LeverFlip, IngestError, RuntimeEvent]


class Checkpoint(SQLModel, table=True):
    """How far the collector has read one file of one source, saved in the same transaction as
    the rows read up to `offset`, so a restart resumes exactly there.

    A file is known by its identity (`file_key` = device:inode) plus a fingerprint (hash of its
    first `fp_len` bytes), so a renamed file is still recognised and a truncated or replaced one
    is not. The row with `file_key = ''` holds what the source remembers between lines (the
    server's last levers), in `state`.
    """

    __tablename__ = "checkpoints"

    source: str = Field(primary_key=True)
    file_key: str = Field(primary_key=True)
    path: str | None = None
    offset: int = Field(default=0, sa_column=Column(BigInteger, nullable=False))
    fp_len: int = 0
    fp: str | None = None
    state: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    updated_at: datetime | None = Field(default=None, sa_column=Column(DateTime(timezone=False)))


TABLES.append(Checkpoint)
