"""Every SQL statement of the store, in one place. All values are bound parameters."""

# The typed columns of `events`, projected from the merged document held in `incoming`.
# `status` is derived when the record has none: an error class or finish_reason "error" means
# the request failed, anything else succeeded (seed-format lines carry no status). `events` has
# no key index: stored rows of the staged requests are deleted first (DELETE_STAGED_EVENTS).
INSERT_STAGED_EVENTS = """
INSERT INTO events
SELECT
    run_id,
    request_id,
    doc->>'source',
    timezone('UTC', TRY_CAST(
        COALESCE(doc->>'ts', doc->>'server_ts', doc->>'log_ts') AS TIMESTAMPTZ
    )),
    doc->>'model',
    doc->>'team',
    doc->>'workload',
    TRY_CAST(doc->>'concurrency' AS INTEGER),
    TRY_CAST(doc->>'target_rate' AS DOUBLE),
    TRY_CAST(doc->>'prompt_tokens' AS INTEGER),
    TRY_CAST(doc->>'completion_tokens' AS INTEGER),
    TRY_CAST(doc->>'cached_tokens' AS INTEGER),
    COALESCE(
        TRY_CAST(doc->>'cache_hit' AS BOOLEAN),
        TRY_CAST(doc->>'cached_tokens' AS HUGEINT) > 0
    ),
    TRY_CAST(doc->>'ttft_ms' AS DOUBLE),
    TRY_CAST(doc->>'tpot_ms' AS DOUBLE),
    TRY_CAST(doc->>'e2e_ms' AS DOUBLE),
    TRY_CAST(doc->'itl_ms' AS DOUBLE[]),
    TRY_CAST(doc->>'queue_ms' AS DOUBLE),
    TRY_CAST(doc->>'prefill_ms' AS DOUBLE),
    TRY_CAST(doc->>'decode_ms' AS DOUBLE),
    doc->>'finish_reason',
    COALESCE(
        doc->>'status',
        CASE WHEN doc->>'error' IS NOT NULL OR doc->>'finish_reason' = 'error'
                  OR doc->>'server_outcome' IN ('failed', 'aborted')
             THEN 'error' ELSE 'ok' END
    ),
    TRY_CAST(doc->>'http_status' AS INTEGER),
    doc->>'error',
    doc->>'trace_id',
    doc
FROM incoming
"""

STAGE_EVENTS = (
    "CREATE OR REPLACE TEMP TABLE incoming (run_id VARCHAR, request_id VARCHAR, doc JSON)"
)
FILL_STAGE = (
    "INSERT INTO incoming SELECT * FROM (SELECT unnest(?) AS r, unnest(?) AS q, unnest(?) AS d)"
)
EXISTING_FOR_STAGE = """
SELECT e.run_id, e.request_id, e.doc
FROM events e JOIN incoming i USING (run_id, request_id)
"""
DELETE_STAGED_EVENTS = """
DELETE FROM events e USING incoming i WHERE e.run_id = i.run_id AND e.request_id = i.request_id
"""
DROP_STAGE = "DROP TABLE incoming"

# Stores made while `events` had a primary key: the table is rebuilt once without it (the new
# table comes from the schema's DDL between the two statements).
EVENTS_KEY_INDEX = """
SELECT count(*) > 0 FROM duckdb_constraints()
WHERE table_name = 'events' AND constraint_type = 'PRIMARY KEY'
"""
UNKEY_EVENTS_RENAME = "ALTER TABLE events RENAME TO events_keyed"
UNKEY_EVENTS_COPY = "INSERT INTO events SELECT * FROM events_keyed; DROP TABLE events_keyed"

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

INSERT_METRIC_SAMPLES = """
INSERT OR IGNORE INTO metric_samples (ts, target, name, labels, run_id, value)
SELECT * FROM (SELECT unnest(?) AS ts, unnest(?) AS target, unnest(?) AS name,
                      unnest(?) AS labels, unnest(?) AS run_id, unnest(?) AS value)
"""

INSERT_LEVER_FLIP = """
INSERT OR IGNORE INTO lever_flips (ts, lever, run_id, before, after, note)
VALUES (?, ?, ?, ?, ?, ?)
"""

INSERT_INGEST_ERROR = """
INSERT OR IGNORE INTO ingest_errors (source, "offset", ts, reason, raw) VALUES (?, ?, ?, ?, ?)
"""

# Runs known from either table: a seed file imported without a `runs` row is still a run.
LIST_RUNS = """
WITH counted AS (
    SELECT run_id, count(*) AS events, min(ts) AS first_ts, max(ts) AS last_ts
    FROM events GROUP BY run_id
)
SELECT run_id, COALESCE(c.events, 0) AS events, r.started_at, r.ended_at, r.label, r.target,
       r.model, r.vllm_version, r.levers, r.workload, r.status, r.notes
FROM runs r FULL OUTER JOIN counted c USING (run_id)
ORDER BY COALESCE(r.started_at, c.first_ts) NULLS LAST, run_id
"""

GET_RUN = "SELECT * FROM runs WHERE run_id = ?"
RUN_EXISTS = """
SELECT EXISTS (SELECT 1 FROM runs WHERE run_id = $run_id)
    OR EXISTS (SELECT 1 FROM events WHERE run_id = $run_id)
"""

EXPORT_EVENTS = "SELECT doc FROM events WHERE run_id = ? ORDER BY ts NULLS LAST, request_id"

# Run-scoped counter deltas, reset-aware: per series (target, labels) the sum of positive steps
# between successive samples; a drop means the server restarted, and the new value counts whole.
COUNTER_DELTAS = """
WITH s AS (
    SELECT target, labels, name, ts, value,
           lag(value) OVER (PARTITION BY target, name, labels ORDER BY ts) AS prev
    FROM metric_samples
    WHERE run_id = $run_id AND list_contains($names, name)
)
SELECT name,
       sum(CASE WHEN prev IS NULL THEN 0
                WHEN value >= prev THEN value - prev
                ELSE value END) AS delta,
       count(*) AS samples
FROM s GROUP BY name
"""

# Peak of gauges over the run, summed across targets sampled at the same instant.
GAUGE_PEAKS = """
WITH per_ts AS (
    SELECT name, ts, sum(value) AS value
    FROM metric_samples
    WHERE run_id = $run_id AND list_contains($names, name)
    GROUP BY name, ts
)
SELECT name, max(value) AS peak FROM per_ts GROUP BY name
"""

# -- reports: a slice of a run (the whole run, or the part before/after a lever flip) -----------
# Every report query takes $run_id, $since and $until (NULL = unbounded; events without a `ts`
# belong only to an unbounded slice), so one set of queries serves `--vs` and `--split-at-flip`.
# `_sliced` pastes this constant condition where a query says SLICE; all values stay parameters.
_IN_SLICE = """run_id = $run_id
    AND (CAST($since AS TIMESTAMP) IS NULL OR ts >= CAST($since AS TIMESTAMP))
    AND (CAST($until AS TIMESTAMP) IS NULL OR ts < CAST($until AS TIMESTAMP))"""


def _sliced(sql: str) -> str:
    return sql.replace("SLICE", _IN_SLICE)


REPORT_LATENCY_METRICS = ("ttft_ms", "tpot_ms", "e2e_ms", "queue_ms", "prefill_ms", "decode_ms")

# A slice's counts, tokens and goodput (SLICE_OVERALL), and the same per load level with the
# latency quantiles (SLICE_LEVELS). One list-quantile aggregate per metric (p50, p90, p95, p99
# from one sorted state) is several times faster than one aggregate per percentile. The
# overall quantiles come from the per-request samples the report sorts for its bootstrap anyway.
# Goodput (vLLM's definition): successful requests meeting every SLO given ($slo_* NULL = none).
_SUMMARY_COLUMNS = """
    count(*) AS requests,
    count(*) FILTER (WHERE status <> 'ok') AS errors,
    (count(*) FILTER (WHERE status <> 'ok'))::DOUBLE / NULLIF(count(*), 0) AS error_rate,
    count(*) FILTER (WHERE status = 'rejected') AS rejected,
    min(ts) AS first_ts,
    max(ts + to_microseconds(CAST(COALESCE(e2e_ms, 0) * 1000 AS BIGINT))) AS last_end_ts,
    sum(prompt_tokens) FILTER (WHERE status = 'ok') AS input_tokens,
    sum(completion_tokens) FILTER (WHERE status = 'ok') AS output_tokens,
    avg(CASE WHEN cache_hit THEN 1.0 WHEN NOT cache_hit THEN 0.0 END) AS cache_hit_request_ratio,
    sum(cached_tokens)::DOUBLE
        / NULLIF(sum(prompt_tokens) FILTER (WHERE cached_tokens IS NOT NULL), 0)
        AS cached_token_ratio,
    avg(prompt_tokens) AS prompt_tokens_mean,
    count(*) FILTER (
        WHERE status = 'ok'
        AND (CAST($slo_ttft_ms AS DOUBLE) IS NULL OR ttft_ms <= $slo_ttft_ms)
        AND (CAST($slo_tpot_ms AS DOUBLE) IS NULL OR tpot_ms <= $slo_tpot_ms)
        AND (CAST($slo_e2e_ms AS DOUBLE) IS NULL OR e2e_ms <= $slo_e2e_ms)
    ) AS good_requests"""

SLICE_OVERALL = _sliced(
    """
SELECT COLUMNS, string_agg(DISTINCT model, ', ' ORDER BY model) AS models
FROM events
WHERE SLICE
"""
).replace("COLUMNS", _SUMMARY_COLUMNS)

SLICE_LEVELS = _sliced(
    """
SELECT workload, concurrency, target_rate, COLUMNS, LATENCY
FROM events
WHERE SLICE
GROUP BY workload, concurrency, target_rate
ORDER BY workload NULLS FIRST, concurrency NULLS FIRST, target_rate NULLS FIRST
"""
)
_LEVEL_LATENCY = ",\n    ".join(
    f"quantile_cont({m}, [0.5, 0.9, 0.95, 0.99]) FILTER (WHERE status = 'ok') AS {m}_q, "
    f"avg({m}) FILTER (WHERE status = 'ok') AS {m}_mean"
    for m in REPORT_LATENCY_METRICS
)
SLICE_LEVELS = SLICE_LEVELS.replace("COLUMNS", _SUMMARY_COLUMNS).replace("LATENCY", _LEVEL_LATENCY)

# ITL as `vllm bench serve` pools it: every gap between content chunks of successful requests.
# Overall and per level as two plain aggregations: faster than grouping sets over the gaps.
SLICE_ITL = _sliced(
    """
SELECT quantile_cont(gap, [0.5, 0.9, 0.95, 0.99]) AS q, avg(gap) AS mean
FROM (SELECT unnest(itl_ms) AS gap FROM events WHERE status = 'ok' AND SLICE)
"""
)
SLICE_GROUP_ITL = _sliced(
    """
SELECT workload, concurrency, target_rate,
       quantile_cont(gap, [0.5, 0.9, 0.95, 0.99]) AS q, avg(gap) AS mean
FROM (SELECT workload, concurrency, target_rate, unnest(itl_ms) AS gap
      FROM events WHERE status = 'ok' AND SLICE)
GROUP BY workload, concurrency, target_rate
"""
)

SLICE_ERRORS_BY_CLASS = _sliced(
    """
SELECT workload, concurrency, target_rate, COALESCE(error, status) AS class, count(*) AS n
FROM events WHERE status <> 'ok' AND SLICE
GROUP BY ALL ORDER BY n DESC, class
"""
)

# Admission rejections: the gateway writes `status = rejected`, `error = rejected:<reason>`.
SLICE_REJECTIONS = _sliced(
    """
SELECT team, COALESCE(NULLIF(regexp_extract(error, '^rejected:(.*)$', 1), ''), error, 'unknown')
           AS reason,
       count(*) AS n
FROM events WHERE status = 'rejected' AND SLICE
GROUP BY ALL ORDER BY team NULLS LAST, reason
"""
)

# Per team: what admission control did to each tenant (isolation evidence).
SLICE_TEAMS = _sliced(
    """
SELECT team, count(*) AS requests,
       count(*) FILTER (WHERE status = 'ok') AS ok,
       count(*) FILTER (WHERE status = 'rejected') AS rejected,
       count(*) FILTER (WHERE status NOT IN ('ok', 'rejected')) AS failed,
       quantile_cont(queue_ms, 0.95) FILTER (WHERE status = 'ok') AS queue_ms_p95,
       count(*) FILTER (WHERE status = 'rejected' AND NOT starts_with(COALESCE(error, ''),
                                                                 'rejected:'))
           AS rejected_without_reason
FROM events WHERE team IS NOT NULL AND SLICE
GROUP BY team ORDER BY team
"""
)

# One row per request: what the bootstrap resamples and the charts draw. NULL becomes NaN
# (not measured), so every column arrives as a plain float array.
SLICE_SAMPLES = _sliced(
    """
SELECT COALESCE(epoch(ts), 'NaN'::DOUBLE) AS t, COALESCE(status = 'ok', false) AS ok,
       COALESCE(ttft_ms, 'NaN'::DOUBLE) AS ttft_ms,
       COALESCE(tpot_ms, 'NaN'::DOUBLE) AS tpot_ms,
       COALESCE(e2e_ms, 'NaN'::DOUBLE) AS e2e_ms,
       COALESCE(queue_ms, 'NaN'::DOUBLE) AS queue_ms,
       COALESCE(prefill_ms, 'NaN'::DOUBLE) AS prefill_ms,
       COALESCE(decode_ms, 'NaN'::DOUBLE) AS decode_ms,
       COALESCE(prompt_tokens::DOUBLE, 'NaN'::DOUBLE) AS prompt_tokens,
       COALESCE(completion_tokens::DOUBLE, 'NaN'::DOUBLE) AS completion_tokens,
       CASE WHEN cache_hit THEN 1.0 WHEN NOT cache_hit THEN 0.0 ELSE 'NaN'::DOUBLE END
           AS cache_hit
FROM events WHERE SLICE
"""
)

# The seeds' pass criteria that need the events themselves. Chat calls are the requests of the
# workloads the run's spec sends to the chat endpoint ($chat_workloads).
SLICE_CHECKS = _sliced(
    """
SELECT
    count(*) AS requests,
    count(*) FILTER (WHERE status = 'timeout' OR error = 'timeout') AS timeouts,
    count(*) FILTER (WHERE status = 'ok') AS ok,
    count(*) FILTER (
        WHERE status = 'ok' AND (model IS NULL OR prompt_tokens IS NULL
              OR completion_tokens IS NULL OR e2e_ms IS NULL)
    ) AS ok_missing_fields,
    count(*) FILTER (WHERE list_contains($chat_workloads, workload)) AS chat_requests,
    count(*) FILTER (WHERE status = 'ok' AND list_contains($chat_workloads, workload)) AS chat_ok
FROM events WHERE SLICE
"""
)

# Out-of-memory failures: the error class or the kept message says so (failed requests only).
SLICE_OOMS = _sliced(
    """
SELECT count(*) AS ooms
FROM events
WHERE status <> 'ok' AND SLICE
  AND regexp_matches(COALESCE(error, '') || ' ' || COALESCE(doc->>'error_detail', ''),
                     '(?i)out of memory|\\bOOM\\b|OutOfMemory')
"""
)

# Server counters and gauges over a slice (same reset-aware rule as COUNTER_DELTAS).
SLICE_COUNTER_DELTAS = _sliced(
    """
WITH s AS (
    SELECT target, labels, name, ts, value,
           lag(value) OVER (PARTITION BY target, name, labels ORDER BY ts) AS prev
    FROM metric_samples
    WHERE list_contains($names, name) AND SLICE
)
SELECT name,
       sum(CASE WHEN prev IS NULL THEN 0
                WHEN value >= prev THEN value - prev
                ELSE value END) AS delta,
       count(*) AS samples
FROM s GROUP BY name
"""
)

SLICE_GAUGE_PEAKS = _sliced(
    """
WITH per_ts AS (
    SELECT name, ts, sum(value) AS value
    FROM metric_samples
    WHERE list_contains($names, name) AND SLICE
    GROUP BY name, ts
)
SELECT name, max(value) AS peak FROM per_ts GROUP BY name
"""
)

# Flips a report marks: those recorded for the runs, or unattributed ones inside their span.
REPORT_LEVER_FLIPS = """
SELECT ts, epoch(ts) AS t, lever, before, after, note, run_id
FROM lever_flips
WHERE list_contains($run_ids, run_id)
   OR (run_id IS NULL AND ts BETWEEN CAST($start AS TIMESTAMP) AND CAST($end AS TIMESTAMP))
ORDER BY ts, lever
"""

RUN_LEVER_FLIPS = """
SELECT ts, lever, before, after, note FROM lever_flips WHERE run_id = $run_id ORDER BY ts, lever
"""

# `report list`: runs with their levers and event counts by outcome, and their lever flips.
REPORT_RUN_LIST = """
WITH counted AS (
    SELECT run_id, count(*) AS events,
           count(*) FILTER (WHERE status = 'ok') AS ok,
           count(*) FILTER (WHERE status = 'rejected') AS rejected,
           count(*) FILTER (WHERE status NOT IN ('ok', 'rejected')) AS errors,
           min(ts) AS first_ts
    FROM events GROUP BY run_id
), flips AS (
    SELECT run_id, count(*) AS flips FROM lever_flips WHERE run_id IS NOT NULL GROUP BY run_id
)
SELECT run_id, COALESCE(c.events, 0) AS events, COALESCE(c.ok, 0) AS ok,
       COALESCE(c.errors, 0) AS errors, COALESCE(c.rejected, 0) AS rejected,
       COALESCE(f.flips, 0) AS flips, r.started_at, r.model, r.levers, r.status
FROM runs r FULL OUTER JOIN counted c USING (run_id) LEFT JOIN flips f USING (run_id)
ORDER BY COALESCE(r.started_at, c.first_ts) NULLS LAST, run_id
"""

# -- agent-runtime events (store/runtime.py) ---------------------------------------------------
# Columns come as parallel lists (run_id, event_id, doc, after_request_id, seq) plus one
# ingestion time; a row already stored (same run_id, event_id) is left as it is.
INSERT_RUNTIME_EVENTS = """
INSERT OR IGNORE INTO runtime_events
    (run_id, event_id, type, ts, request_id, trace_id, after_request_id, ingested_at, seq, doc)
SELECT r, e, d->>'type', timezone('UTC', TRY_CAST(d->>'ts' AS TIMESTAMPTZ)),
       d->>'request_id', d->>'trace_id', a, $6, s, d
FROM (SELECT unnest($1) AS r, unnest($2) AS e, unnest($3)::JSON AS d,
             unnest($4) AS a, unnest($5) AS s)
"""

RUNTIME_TABLE_EXISTS = (
    "SELECT count(*) > 0 FROM duckdb_tables() WHERE table_name = 'runtime_events'"
)

EXPORT_EVENTS_TS = "SELECT ts, doc FROM events WHERE run_id = ? ORDER BY ts NULLS LAST, request_id"

EXPORT_RUNTIME_EVENTS = """
SELECT ts, after_request_id, doc FROM runtime_events WHERE run_id = ? ORDER BY ingested_at, seq
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
WHERE r.run_id = ?
ORDER BY r.ingested_at, r.seq
"""

RUNTIME_RUN_EXISTS = """
SELECT count(*) > 0 FROM runtime_events WHERE run_id = ?
"""

# -- collector: checkpoints and bulk `.events.jsonl` lines (store/bulk.py) ----------------------
UPSERT_CHECKPOINT = """
INSERT OR REPLACE INTO checkpoints (source, file_key, path, "offset", fp_len, fp, state, updated_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?)
"""
LIST_CHECKPOINTS = """
SELECT source, file_key, path, "offset", fp_len, fp, state, updated_at
FROM checkpoints WHERE source = ? ORDER BY file_key
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

# Each line parsed once, into the raw JSON of each contract key (NULL when absent, null or not
# an object). `{ok}` (store/bulk.py, from the contract) is stricter than `store.events.check`,
# so every line it accepts `check` accepts too; such a line is inserted when its request is not
# stored yet, with the typed columns of INSERT_STAGED_EVENTS computed from the same parse.
BULK_INSERT = """
INSERT INTO events
SELECT run_key, request_key, source->>'$',
    timezone('UTC', TRY_CAST(COALESCE(ts->>'$', server_ts->>'$', log_ts->>'$') AS TIMESTAMPTZ)),
    model->>'$', team->>'$', workload->>'$',
    TRY_CAST(concurrency::VARCHAR AS INTEGER), TRY_CAST(target_rate::VARCHAR AS DOUBLE),
    TRY_CAST(prompt_tokens::VARCHAR AS INTEGER), TRY_CAST(completion_tokens::VARCHAR AS INTEGER),
    TRY_CAST(cached_tokens::VARCHAR AS INTEGER),
    COALESCE(TRY_CAST(cache_hit::VARCHAR AS BOOLEAN),
             TRY_CAST(cached_tokens::VARCHAR AS HUGEINT) > 0),
    TRY_CAST(ttft_ms::VARCHAR AS DOUBLE), TRY_CAST(tpot_ms::VARCHAR AS DOUBLE),
    TRY_CAST(e2e_ms::VARCHAR AS DOUBLE), TRY_CAST(itl_ms AS DOUBLE[]),
    TRY_CAST(queue_ms::VARCHAR AS DOUBLE), TRY_CAST(prefill_ms::VARCHAR AS DOUBLE),
    TRY_CAST(decode_ms::VARCHAR AS DOUBLE),
    finish_reason->>'$',
    COALESCE(
        status->>'$',
        CASE WHEN error->>'$' IS NOT NULL OR finish_reason->>'$' = 'error'
                  OR server_outcome->>'$' IN ('failed', 'aborted')
             THEN 'error' ELSE 'ok' END
    ),
    TRY_CAST(http_status::VARCHAR AS INTEGER), error->>'$', trace_id->>'$', line
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
BULK_DROP_REPEATED = """
DELETE FROM events WHERE rowid > $after AND (run_id, request_id) IN (
    SELECT run_id, request_id FROM events WHERE rowid > $after GROUP BY ALL HAVING count(*) > 1
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
# The lines the insert did not take, once each (store/bulk.py finds where they stand).
BULK_REST = """
SELECT line FROM {lines} WHERE line <> ''
EXCEPT
SELECT doc::VARCHAR FROM events WHERE rowid > $after
"""

# -- Parquet export (store/parquet.py): hive partitions run_id=…/date=… ------------------------
# $1 is a run_id, or NULL for every run; $2 the output folder, replaced as a whole; $3/$4 map the
# run ids too long for a folder name to a short stand-in (store.paths.partition_value). `doc` is
# written as text so any reader takes it. COPY answers with the number of rows written.
_PARQUET_COPY = """
COPY (
    SELECT t.* EXCLUDE (doc, run_id), COALESCE(m.part, t.run_id) AS run_id,
        CAST(ts AS DATE) AS date, CAST(doc AS VARCHAR) AS doc
    FROM {table} t
    LEFT JOIN (SELECT unnest($3::VARCHAR[]) AS rid, unnest($4::VARCHAR[]) AS part) m
        ON m.rid = t.run_id
    WHERE $1::VARCHAR IS NULL OR t.run_id = $1
) TO $2 (FORMAT parquet, PARTITION_BY (run_id, date), OVERWRITE)
"""
PARQUET_EVENTS = _PARQUET_COPY.format(table="events")
PARQUET_RUNTIME_EVENTS = _PARQUET_COPY.format(table="runtime_events")
PARQUET_RUN_IDS = "SELECT DISTINCT run_id FROM {table} WHERE $1::VARCHAR IS NULL OR run_id = $1"
PARQUET_COUNT = "SELECT count(*) FROM read_parquet($1, hive_partitioning = true)"

# The stored (merged) records of some requests, by (run_id, request_id): what the collector's
# OTLP forwarder sends once a request's pieces have settled.
EVENTS_BY_KEYS = """
SELECT e.doc FROM events e
JOIN (SELECT unnest($1) AS run_id, unnest($2) AS request_id) k USING (run_id, request_id)
"""
