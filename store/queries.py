"""The store's SQL: its write path, its own reads, and the primitives the reports build on (the
session-run rule, counter growth, gauge peaks). The reports' own SQL is `reports/sql.py`.

Values are bound parameters (`$name`); a statement made of parts is composed from the named
constants and functions here, never by replacing marker words in a text.

The statements (the upper-case constants) are the store's own: other rooms run them through
`store.reads` or `Store`, never on a connection of theirs, so a table can change with its
statements in one room. What other rooms compose their own statements from is functions:
`session_run`, `counter_step`, `counter_growth`, `counter_deltas`, `gauge_peaks`
(tests/integration/test_layout.py checks both).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# A column of a table as (name, DuckDB type), in store/schema.py's order (`store.tables`
# derives them from the SQLModel classes).
Columns = Sequence[tuple[str, str]]


# -- a record's typed columns ------------------------------------------------------------------
# The typed columns of `events` are projections of the record (`doc`), by each column's type:
# text as it is, other scalars cast (NULL when the value is not of the type), lists as JSON cast.
# Five columns have rules of their own. `status` is derived when the record has none: an error
# class or finish_reason "error" means the request failed, anything else succeeded (seed-format
# lines carry no status). Two statements read records, each in its own form: the ordinary path
# (`Store.add_events`) a whole merged document per request, staged in `incoming`; the bulk
# statement (store/bulk.py) each key's raw JSON, parsed once per line.
@dataclass(frozen=True)
class _RecordForm:
    """How a statement reads one key of a record."""

    text: Callable[[str], str]  # the value as text (NULL unless a JSON string)
    scalar: Callable[[str], str]  # the value's text, to be cast
    json: Callable[[str], str]  # the value as JSON
    run_id: str
    request_id: str
    doc: str

    def column(self, name: str, sql_type: str) -> str:
        """The SQL giving column `name` (of type `sql_type`) from the record."""
        special = {
            "run_id": self.run_id,
            "request_id": self.request_id,
            "doc": self.doc,
            "ts": (
                "timezone('UTC', TRY_CAST("
                f"COALESCE({self.text('ts')}, {self.text('server_ts')}, {self.text('log_ts')})"
                " AS TIMESTAMPTZ))"
            ),
            "cache_hit": (
                f"COALESCE(TRY_CAST({self.scalar('cache_hit')} AS BOOLEAN),"
                f" TRY_CAST({self.scalar('cached_tokens')} AS HUGEINT) > 0)"
            ),
            "status": (
                f"COALESCE({self.text('status')},"
                f" CASE WHEN {self.text('error')} IS NOT NULL"
                f" OR {self.text('finish_reason')} = 'error'"
                f" OR {self.text('server_outcome')} IN ('failed', 'aborted')"
                " THEN 'error' ELSE 'ok' END)"
            ),
        }
        if name in special:
            return special[name]
        if sql_type == "VARCHAR":
            return self.text(name)
        if sql_type.endswith("[]"):
            return f"TRY_CAST({self.json(name)} AS {sql_type})"
        return f"TRY_CAST({self.scalar(name)} AS {sql_type})"

    def select(self, columns: Columns) -> str:
        return ",\n    ".join(self.column(name, sql_type) for name, sql_type in columns)


# a merged document (`doc`, JSON text) and its key
_DOCUMENT = _RecordForm(
    text=lambda key: f"doc->>'{key}'",
    scalar=lambda key: f"doc->>'{key}'",
    json=lambda key: f"doc->'{key}'",
    run_id="run_id",
    request_id="request_id",
    doc="doc",
)
# a line parsed into one raw JSON column per key (store/bulk.py's `$shape`)
_PARSED_LINE = _RecordForm(
    text=lambda key: f"{key}->>'$'",
    scalar=lambda key: f"{key}::VARCHAR",
    json=lambda key: key,
    run_id="run_key",
    request_id="request_key",
    doc="line",
)


def event_column_from_doc(name: str, sql_type: str) -> str:
    """How column `name` of `events` is read from a row's `doc` (a column added to an older
    store is filled so)."""
    return _DOCUMENT.column(name, sql_type)


def _names(columns: Columns) -> str:
    # Every insert names its columns: a store that a newer version gave more columns still
    # takes this version's rows, and a sidecar keeps ingesting while a newer `servescope` reads
    # the same store.
    return ", ".join(name for name, _type in columns)


# -- the ordinary write path (Store.add_events) ------------------------------------------------
# `events` has no key index: stored rows of the staged requests are deleted first
# (DELETE_STAGED_EVENTS), then the merged rows inserted from `incoming`.
def insert_staged_events(columns: Columns) -> str:
    return f"""
INSERT INTO events ({_names(columns)})
SELECT
    {_DOCUMENT.select(columns)}
FROM incoming
"""


STAGE_EVENTS = (
    "CREATE OR REPLACE TEMP TABLE incoming (run_id VARCHAR, request_id VARCHAR, doc JSON)"
)
FILL_STAGE = """
INSERT INTO incoming
SELECT * FROM (SELECT unnest($runs) AS r, unnest($requests) AS q, unnest($docs) AS d)
"""
EXISTING_FOR_STAGE = """
SELECT e.run_id, e.request_id, e.doc
FROM events e JOIN incoming i USING (run_id, request_id)
"""
DELETE_STAGED_EVENTS = """
DELETE FROM events e USING incoming i WHERE e.run_id = i.run_id AND e.request_id = i.request_id
"""
DROP_STAGE = "DROP TABLE incoming"

# -- schema upkeep (store/tables.py derives the tables from store/schema.py) -------------------
# Stores made while `events` had a primary key: the table is rebuilt once without it (the new
# table comes from the schema's DDL between the two statements).
EVENTS_KEY_INDEX = """
SELECT count(*) > 0 FROM duckdb_constraints()
WHERE table_name = 'events' AND constraint_type = 'PRIMARY KEY'
"""
UNKEY_EVENTS_RENAME = "ALTER TABLE events RENAME TO events_keyed"
UNKEY_EVENTS_COPY = "INSERT INTO events SELECT * FROM events_keyed; DROP TABLE events_keyed"
# The (table, column) pairs of the schema a store lacks (its tables included).
MISSING_COLUMNS = """
SELECT t.name, t.col FROM (SELECT unnest($tables) AS name, unnest($columns) AS col) t
WHERE NOT EXISTS (SELECT 1 FROM duckdb_columns() c
                  WHERE c.table_name = t.name AND c.column_name = t.col)
"""
# What a store says of its schema: the comment of its `events` table (`store.db.schema_stamp`).
SCHEMA_STAMP = "SELECT comment FROM duckdb_tables() WHERE table_name = 'events'"


def stamp_schema(stamp: str) -> str:
    """`stamp` (hex digits: a literal, as COMMENT takes no parameter) as the store's."""
    if not stamp.isalnum():
        raise ValueError(f"not a schema stamp: {stamp!r}")
    return f"COMMENT ON TABLE events IS '{stamp}'"


UPSERT_RUN = """
INSERT INTO runs AS r (run_id, started_at, ended_at, label, target, model, vllm_version,
                       levers, workload, status, notes)
VALUES ($run_id, $started_at, $ended_at, $label, $target, $model, $vllm_version,
        $levers, $workload, $status, $notes)
ON CONFLICT (run_id) DO UPDATE SET
    started_at = COALESCE(excluded.started_at, r.started_at),
    ended_at = COALESCE(excluded.ended_at, r.ended_at),
    label = COALESCE(excluded.label, r.label),
    target = COALESCE(excluded.target, r.target),
    model = COALESCE(excluded.model, r.model),
    vllm_version = COALESCE(excluded.vllm_version, r.vllm_version),
    levers = COALESCE(excluded.levers, r.levers),
    workload = COALESCE(excluded.workload, r.workload),
    status = COALESCE(excluded.status, r.status),
    notes = COALESCE(excluded.notes, r.notes)
"""

# Parallel lists, one statement: executemany pays a round trip a row, and a /metrics page has
# hundreds of rows.
INSERT_METRIC_SAMPLES = """
INSERT OR IGNORE INTO metric_samples (ts, target, name, labels, run_id, value)
SELECT * FROM (SELECT unnest($ts) AS ts, unnest($target) AS target, unnest($name) AS name,
                      unnest($labels) AS labels, unnest($run_id) AS run_id,
                      unnest($value) AS value)
"""

INSERT_LEVER_FLIP = """
INSERT OR IGNORE INTO lever_flips (ts, lever, run_id, before, after, note, before_run_id)
VALUES ($ts, $lever, $run_id, $before, $after, $note, $before_run_id)
"""
# A restart's flips are written whole each time the session's levers are known better.
DELETE_SESSION_FLIPS = "DELETE FROM lever_flips WHERE run_id = $run_id AND before_run_id = $before"
SESSION_FLIPS = """
SELECT lever, before, after FROM lever_flips
WHERE run_id = $run_id AND before_run_id = $before ORDER BY lever
"""
# `report flips`: every lever flip, grouped by the change of runs it belongs to.
FLIP_LIST = """
SELECT min(ts) AS ts, run_id, before_run_id,
       list({'lever': lever, 'before': before, 'after': after} ORDER BY lever) AS changes,
       any_value(note) AS note
FROM lever_flips GROUP BY run_id, before_run_id ORDER BY min(ts), run_id
"""

# Requests by id alone (vLLM's own ids are random, unique across runs): where each is stored.
RUNS_OF_REQUESTS = """
SELECT DISTINCT e.request_id, e.run_id FROM events e
JOIN (SELECT unnest($ids) AS request_id) k USING (request_id)
"""
# Requests of one run, taken out to be stored again under another run.
TAKE_EVENTS = """
DELETE FROM events e USING (SELECT unnest($ids) AS request_id) k
WHERE e.run_id = $run_id AND e.request_id = k.request_id
RETURNING e.doc
"""

INSERT_INGEST_ERROR = """
INSERT OR IGNORE INTO ingest_errors (source, "offset", ts, reason, raw)
VALUES ($source, $offset, $ts, $reason, $raw)
"""

# -- runs: the store's reads, which the reports share ------------------------------------------
GET_RUN = "SELECT * FROM runs WHERE run_id = $run_id"
RUN_EXISTS = """
SELECT EXISTS (SELECT 1 FROM runs WHERE run_id = $run_id)
    OR EXISTS (SELECT 1 FROM events WHERE run_id = $run_id)
"""

# The server sessions that served a run's requests, with their notes (their start-up phases).
SERVING_SESSIONS = """
SELECT r.run_id, r.notes
FROM runs r
WHERE r.run_id IN (SELECT DISTINCT vllm_session FROM events
                   WHERE run_id = $run_id AND vllm_session IS NOT NULL)
ORDER BY r.started_at
"""

EXPORT_EVENTS = "SELECT doc FROM events WHERE run_id = $run_id ORDER BY ts NULLS LAST, request_id"

# A run's successful requests, and how many of them carry vLLM's own timings (its trace).
TRACED_REQUESTS = """
SELECT count(*), count(server_ttft_ms) FROM events WHERE run_id = $run_id AND status = 'ok'
"""

# Every run (`store runs`, `report list`), known from either table: a file imported without a
# `runs` row is still a run, its model and times read from its events. Event counts by outcome,
# lever flips.
LIST_RUNS = """
WITH counted AS (
    SELECT run_id, count(*) AS events,
           count(*) FILTER (WHERE status = 'ok') AS ok,
           count(*) FILTER (WHERE status = 'rejected') AS rejected,
           count(*) FILTER (WHERE status NOT IN ('ok', 'rejected')) AS errors,
           min(ts) AS first_ts, max(ts) AS last_ts, min(model) AS model
    FROM events GROUP BY run_id
), flips AS (
    SELECT run_id, count(*) AS flips FROM lever_flips WHERE run_id IS NOT NULL GROUP BY run_id
)
SELECT run_id, COALESCE(c.events, 0) AS events, COALESCE(c.ok, 0) AS ok,
       COALESCE(c.errors, 0) AS errors, COALESCE(c.rejected, 0) AS rejected,
       COALESCE(f.flips, 0) AS flips, COALESCE(r.started_at, c.first_ts) AS started_at,
       COALESCE(r.ended_at, c.last_ts) AS ended_at, r.label, r.target,
       COALESCE(r.model, c.model) AS model, r.vllm_version, r.levers, r.workload, r.status,
       r.notes
FROM runs r FULL OUTER JOIN counted c USING (run_id) LEFT JOIN flips f USING (run_id)
ORDER BY COALESCE(r.started_at, c.first_ts) NULLS LAST, run_id
"""


# -- `/metrics` samples of a run: counter growth and gauge peaks -------------------------------
# A server session's run (`vllm-…`, collector/sessions.py) holds one vLLM process's samples and
# the requests it served for client runs (`vllm_session`). The test is on a bound parameter: for
# any other run it folds away, so a bench run's statements read no more than before.
def session_run(run_id: str = "$run_id") -> str:
    """True when `run_id` (SQL: a parameter or a column) names a server session's run."""
    return f"starts_with({run_id}, 'vllm-')"


# Is it a fleet run (requests routed by the gateway to a pool of replicas)? Its first events
# carry routing decisions in their verbatim record (any other run pays this much): read by the
# report's replicas table (reports/replicas.py), and by a lake reader deciding whether a report
# needs `doc` (store/lakeread.py).
ROUTED_SAMPLE = """
SELECT count(*) FROM (
    SELECT doc FROM events WHERE run_id = $run_id LIMIT $rows
) WHERE doc->>'routing' IS NOT NULL OR doc->>'route_reason' IS NOT NULL
"""
ROUTED_SAMPLE_ROWS = 64  # events looked at


# How much a counter grew: per series (target, labels) the sum of its steps between successive
# samples, a drop meaning the server restarted (the new value counts whole). A server session's
# run holds one process's samples, whose counters began at 0 with it: there the first sample
# counts whole too (`first`), so a session short enough to be scraped once is still measured.
# `steps` counts the steps taken: 0 is "not measured", never "zero".
def counter_step(first: str) -> str:
    """A sample's step from the one before it (`prev`); `first` when it is the first."""
    return f"""CASE WHEN prev IS NULL THEN {first}
            WHEN value >= prev THEN value - prev
            ELSE value END"""


def counter_growth(step: str = "step") -> str:
    """The growth of the `step`s (`counter_step`) a group holds, and how many there were."""
    return f"sum({step}) AS delta, count({step}) AS steps"


def counter_deltas(names: str, keys: str, window: str = "") -> str:
    """Counter growth of the run's series that `names` selects, grouped by `keys`. Steps are
    taken over all the run's samples, then kept when they end inside `window` (an `AND …` on
    `ts`), so a window's first step starts before it."""
    return f"""
WITH s AS (
    SELECT target, labels, name, ts, value,
           lag(value) OVER (PARTITION BY target, name, labels ORDER BY ts) AS prev
    FROM metric_samples
    WHERE run_id = $run_id AND {names}
),
steps AS (SELECT *, {counter_step(f"CASE WHEN {session_run()} THEN value END")} AS step
          FROM s WHERE true{window})
SELECT {keys}, {counter_growth()} FROM steps GROUP BY ALL
"""


# Gauges that are a share of one engine's capacity: several engines (or replicas) at the same
# instant are as full as the fullest, never the sum of their shares.
SHARE_GAUGES = ("vllm:kv_cache_usage_perc",)


def gauge_peaks(where: str) -> str:
    """The peak of each gauge over the samples `where` selects, summed across the series
    sampled at the same instant (the engines of a data-parallel server, the targets of a
    fleet): requests running or waiting add up; a share of capacity (`SHARE_GAUGES`) is the
    largest one's."""
    shares = ", ".join(f"'{name}'" for name in SHARE_GAUGES)
    return f"""
WITH per_ts AS (
    SELECT name, ts,
           CASE WHEN name IN ({shares}) THEN max(value) ELSE sum(value) END AS value
    FROM metric_samples
    WHERE {where}
    GROUP BY name, ts
)
SELECT name, max(value) AS peak FROM per_ts GROUP BY name
"""


COUNTER_DELTAS = counter_deltas("list_contains($names, name)", "name")
GAUGE_PEAKS = gauge_peaks("run_id = $run_id AND list_contains($names, name)")

# -- agent-runtime events (store/runtime.py) ---------------------------------------------------
# Columns come as parallel lists (run_id, event_id, doc, after_request_id, seq) plus one
# ingestion time; a row already stored (same run_id, event_id) is left as it is.
INSERT_RUNTIME_EVENTS = """
INSERT OR IGNORE INTO runtime_events
    (run_id, event_id, type, ts, request_id, trace_id, after_request_id, ingested_at, seq, doc)
SELECT r, e, d->>'type', timezone('UTC', TRY_CAST(d->>'ts' AS TIMESTAMPTZ)),
       d->>'request_id', d->>'trace_id', a, $ingested_at, s, d
FROM (SELECT unnest($runs) AS r, unnest($event_ids) AS e, unnest($docs)::JSON AS d,
             unnest($anchors) AS a, unnest($seqs) AS s)
"""

RUNTIME_TABLE_EXISTS = (
    "SELECT count(*) > 0 FROM duckdb_tables() WHERE table_name = 'runtime_events'"
)

EXPORT_EVENTS_TS = """
SELECT ts, doc FROM events WHERE run_id = $run_id ORDER BY ts NULLS LAST, request_id
"""

EXPORT_RUNTIME_EVENTS = """
SELECT ts, after_request_id, doc FROM runtime_events WHERE run_id = $run_id
ORDER BY ingested_at, seq
"""

# A runtime event belongs to the request with its request_id or, failing that, its trace_id.
RUNTIME_EVENTS_JOINED = """
SELECT r.doc,
       COALESCE(
           (SELECT e.doc FROM events e WHERE e.request_id = r.request_id
            ORDER BY e.run_id = r.run_id DESC LIMIT 1),
           (SELECT e.doc FROM events e WHERE e.trace_id = r.trace_id
            ORDER BY e.run_id = r.run_id DESC LIMIT 1)
       )
FROM runtime_events r
WHERE r.run_id = $run_id
ORDER BY r.ingested_at, r.seq
"""

RUNTIME_RUN_EXISTS = """
SELECT count(*) > 0 FROM runtime_events WHERE run_id = $run_id
"""

# -- collector: checkpoints and bulk `.events.jsonl` lines (store/bulk.py) ----------------------
UPSERT_CHECKPOINT = """
INSERT OR REPLACE INTO checkpoints (source, file_key, path, "offset", fp_len, fp, state, updated_at)
VALUES ($source, $file_key, $path, $offset, $fp_len, $fp, $state, $updated_at)
"""
LIST_CHECKPOINTS = """
SELECT source, file_key, path, "offset", fp_len, fp, state, updated_at
FROM checkpoints WHERE source = $source ORDER BY file_key
"""

# A chunk of complete lines, written by store/bulk.py to a temporary file, as rows `line`:
# DuckDB's parallel CSV reader with quoting off and a delimiter the chunk does not contain (an
# empty line is NULL); or one split of the whole text, on one thread, for a chunk the CSV reader
# would cut differently (a carriage return is a line end to it; the delimiter; over-long lines).
BULK_LINES_CSV = """read_csv($path, columns = {'line': 'VARCHAR'}, delim = chr(31),
    quote = '', escape = '', header = false, auto_detect = false, new_line = '\\n',
    max_line_size = $max_line)"""
BULK_LINES_TEXT = """(SELECT rtrim(unnest(string_split(content, chr(10))), chr(13)) AS line
    FROM read_text($path))"""

# Rows appended in a transaction get row ids above every row id the table had before, so
# `rowid > $after` (BULK_LAST_ROWID, read just before) is what one bulk insert wrote.
BULK_LAST_ROWID = "SELECT COALESCE(max(rowid), -1) FROM events"


def bulk_insert(columns: Columns, lines: str, ok: str) -> str:
    """Each line of `lines` (BULK_LINES_CSV or BULK_LINES_TEXT) parsed once, into the raw JSON
    of each key of `$shape` (NULL when absent, null or not an object). `ok` (store/bulk.py, from
    the contract) is stricter than `store.validation.check`, so every line it accepts `check`
    accepts too; such a line is inserted when its request is not stored yet, its typed columns
    computed from the same parse by the rules of the ordinary path."""
    return f"""
INSERT INTO events ({_names(columns)})
SELECT
    {_PARSED_LINE.select(columns)}
FROM (
    SELECT *, request_id->>'$' AS request_key,
           COALESCE(NULLIF(run_id->>'$', ''),
                    regexp_replace(request_id->>'$', '-[0-9]+$', '')) AS run_key
    FROM (SELECT line, unnest(try(json_transform(line, $shape))) FROM {lines})
    WHERE {ok}
) p
WHERE NOT EXISTS (
    SELECT 1 FROM events e WHERE e.run_id = p.run_key AND e.request_id = p.request_key
)
"""


# A request on several lines of one chunk is merged by the ordinary path: its rows go again.
# By the key's hash, which groups several times faster than the two strings: a collision only
# sends a request the statement had written to the ordinary path (`bulk_rest` finds its line).
BULK_DROP_REPEATED = """
DELETE FROM events WHERE rowid > $after AND hash(run_id, request_id) IN (
    SELECT hash(run_id, request_id) FROM events WHERE rowid > $after GROUP BY 1 HAVING count(*) > 1
)
"""
# Requests that a line screened out of the statement carries too (store/bulk.py): their rows go
# again, and all their lines are merged in file order by the ordinary path.
BULK_DROP_KEYS = """
DELETE FROM events WHERE rowid > $after AND (run_id, request_id) IN (
    SELECT unnest($runs::VARCHAR[]), unnest($requests::VARCHAR[])
)
"""
BULK_NEW_KEYS = "SELECT run_id, request_id FROM events WHERE rowid > $after ORDER BY rowid"


def bulk_rest(lines: str) -> str:
    """The lines of `lines` the insert did not take, once each (store/bulk.py finds where
    they stand)."""
    return f"""
SELECT line FROM {lines} WHERE line <> ''
EXCEPT
SELECT doc::VARCHAR FROM events WHERE rowid > $after
"""


# -- Parquet export (store/parquet.py): hive partitions run_id=…/date=… ------------------------
# $run_id is a run, or NULL for every run; $out the output folder, replaced as a whole;
# $long/$short map the run ids too long for a folder name to a short stand-in
# (store.paths.partition_value). `doc` is written as text so any reader takes it. COPY answers
# with the number of rows written.
def parquet_copy(table: str) -> str:
    return f"""
COPY (
    SELECT t.* EXCLUDE (doc, run_id), COALESCE(m.part, t.run_id) AS run_id,
        CAST(ts AS DATE) AS date, CAST(doc AS VARCHAR) AS doc
    FROM {table} t
    LEFT JOIN (SELECT unnest($long::VARCHAR[]) AS rid, unnest($short::VARCHAR[]) AS part) m
        ON m.rid = t.run_id
    WHERE $run_id::VARCHAR IS NULL OR t.run_id = $run_id
) TO $out (FORMAT parquet, PARTITION_BY (run_id, date), OVERWRITE)
"""


def parquet_run_ids(table: str) -> str:
    return f"SELECT DISTINCT run_id FROM {table} WHERE $run_id::VARCHAR IS NULL OR run_id = $run_id"


PARQUET_COUNT = "SELECT count(*) FROM read_parquet($files, hive_partitioning = true)"

# The stored (merged) records of some requests, by (run_id, request_id): what the collector's
# OTLP forwarder sends once a request's pieces have settled.
EVENTS_BY_KEYS = """
SELECT e.doc FROM events e
JOIN (SELECT unnest($1) AS run_id, unnest($2) AS request_id) k USING (run_id, request_id)
"""

# `servescope capacity --from-run`: a run's request shape and measured speed (successful requests).
RUN_TRAFFIC = """
SELECT count(*) AS requests,
       quantile_cont(prompt_tokens, [0.5, 0.95]) AS prompt_q,
       quantile_cont(completion_tokens, [0.5, 0.95]) AS output_q,
       quantile_cont(ttft_ms, 0.95) AS ttft_p95,
       (SELECT quantile_cont(gap, 0.95)
        FROM (SELECT unnest(itl_ms) AS gap FROM events
              WHERE run_id = $run_id AND status = 'ok')) AS itl_p95,
       sum(COALESCE(prompt_tokens, 0) + COALESCE(completion_tokens, 0)) AS tokens,
       epoch(max(ts + to_microseconds(CAST(COALESCE(e2e_ms, 0) * 1000 AS BIGINT))))
           - epoch(min(ts)) AS seconds
FROM events WHERE run_id = $run_id AND status = 'ok'
"""

# -- retention of `/metrics` samples (store/retention.py) --------------------------------------
# Samples older than the cutoff are dropped. In [$start, $end) each series (target, name, labels,
# run_id) keeps one sample a minute, the minute's last: the others are "superseded" (the primary
# key makes `ts` unique within a series, so the last one is never a tie). Both filter on `ts`
# first, which DuckDB answers from each row group's zone map: a pass with nothing to do reads
# almost nothing.
# Both are done in slices of time holding about the same number of rows (SAMPLES_IN_WINDOW
# tells), one transaction each.
SAMPLES_IN_WINDOW = """
SELECT min(ts), count(*) FROM metric_samples WHERE ts >= $start AND ts < $end
"""
DROP_SAMPLES = "DELETE FROM metric_samples WHERE ts >= $start AND ts < $end"
_SUPERSEDED_SAMPLES = """
SELECT rowid FROM (
    SELECT rowid, row_number() OVER (
        PARTITION BY target, name, labels, run_id, date_trunc('minute', ts) ORDER BY ts DESC
    ) AS newer
    FROM metric_samples WHERE ts >= $start AND ts < $end
) WHERE newer > 1
"""
COUNT_SUPERSEDED_SAMPLES = f"SELECT count(*) FROM ({_SUPERSEDED_SAMPLES})"
DOWNSAMPLE_SAMPLES = f"""
DELETE FROM metric_samples
WHERE ts >= $start AND ts < $end AND rowid IN ({_SUPERSEDED_SAMPLES})
"""
COUNT_SAMPLES = "SELECT count(*) FROM metric_samples"
