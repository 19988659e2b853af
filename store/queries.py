"""Every SQL statement of the store, in one place. All values are bound parameters."""

# The columns of `events` every insert names (store/schema.py's order): a store that a newer
# version gave more columns still takes this version's rows, and a sidecar keeps ingesting while
# a newer `servescope` reads the same store.
EVENT_COLUMNS = (
    "run_id, request_id, source, ts, model, team, workload, concurrency, target_rate,"
    " prompt_tokens, completion_tokens, cached_tokens, cache_hit, ttft_ms, tpot_ms, e2e_ms,"
    " itl_ms, queue_ms, prefill_ms, decode_ms, finish_reason, status, http_status, error,"
    " trace_id, doc, server_ttft_ms, server_e2e_ms, vllm_session, error_detail, server_tpot_ms"
)

# The typed columns of `events`, projected from the merged document held in `incoming`.
# `status` is derived when the record has none: an error class or finish_reason "error" means
# the request failed, anything else succeeded (seed-format lines carry no status). `events` has
# no key index: stored rows of the staged requests are deleted first (DELETE_STAGED_EVENTS).
INSERT_STAGED_EVENTS = """
INSERT INTO events (COLUMNS)
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
    doc,
    TRY_CAST(doc->>'server_ttft_ms' AS DOUBLE),
    TRY_CAST(doc->>'server_e2e_ms' AS DOUBLE),
    doc->>'vllm_session',
    doc->>'error_detail',
    TRY_CAST(doc->>'server_tpot_ms' AS DOUBLE)
FROM incoming
""".replace("COLUMNS", EVENT_COLUMNS)

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
# Columns added since the first stores: (table, column, type, how existing rows get it).
ADDED_COLUMNS = (
    ("events", "server_ttft_ms", "DOUBLE", "TRY_CAST(doc->>'server_ttft_ms' AS DOUBLE)"),
    ("events", "server_e2e_ms", "DOUBLE", "TRY_CAST(doc->>'server_e2e_ms' AS DOUBLE)"),
    ("events", "vllm_session", "VARCHAR", "doc->>'vllm_session'"),
    ("events", "error_detail", "VARCHAR", "doc->>'error_detail'"),
    ("events", "server_tpot_ms", "DOUBLE", "TRY_CAST(doc->>'server_tpot_ms' AS DOUBLE)"),
    ("lever_flips", "before_run_id", "VARCHAR", None),
)
MISSING_COLUMNS = """
SELECT t.name, t.col FROM (SELECT unnest($tables) AS name, unnest($columns) AS col) t
WHERE NOT EXISTS (SELECT 1 FROM duckdb_columns() c
                  WHERE c.table_name = t.name AND c.column_name = t.col)
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
INSERT OR IGNORE INTO lever_flips (ts, lever, run_id, before, after, note, before_run_id)
VALUES (?, ?, ?, ?, ?, ?, ?)
"""
# A restart's flips are written whole each time the session's levers are known better.
DELETE_SESSION_FLIPS = "DELETE FROM lever_flips WHERE run_id = $run_id AND before_run_id = $before"
SESSION_FLIPS = """
SELECT lever, before, after FROM lever_flips
WHERE run_id = $run_id AND before_run_id = $before ORDER BY lever
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
INSERT OR IGNORE INTO ingest_errors (source, "offset", ts, reason, raw) VALUES (?, ?, ?, ?, ?)
"""

GET_RUN = "SELECT * FROM runs WHERE run_id = ?"
RUN_EXISTS = """
SELECT EXISTS (SELECT 1 FROM runs WHERE run_id = $run_id)
    OR EXISTS (SELECT 1 FROM events WHERE run_id = $run_id)
"""

EXPORT_EVENTS = "SELECT doc FROM events WHERE run_id = ? ORDER BY ts NULLS LAST, request_id"

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
_IN_WINDOW = """
    AND (CAST($since AS TIMESTAMP) IS NULL OR ts >= CAST($since AS TIMESTAMP))
    AND (CAST($until AS TIMESTAMP) IS NULL OR ts < CAST($until AS TIMESTAMP))"""
# A server session's run (`vllm-…`, collector/sessions.py) also holds the requests it served for
# client runs (`vllm_session`); for any other run the test folds away (the parameter is bound as
# a constant), so a bench run's slice reads no more than its own rows.
_SESSION_RUN = "starts_with($run_id, 'vllm-')"
_IN_SLICE = f"(run_id = $run_id OR ({_SESSION_RUN} AND vllm_session = $run_id))" + _IN_WINDOW
_SAMPLES_IN_SLICE = "run_id = $run_id" + _IN_WINDOW


def _sliced(sql: str) -> str:
    return sql.replace("SLICE", _IN_SLICE)


def _samples_sliced(sql: str) -> str:
    return sql.replace("SLICE", _SAMPLES_IN_SLICE)


# The per-request latencies a report summarises (overall and per level), bootstraps and draws:
# name -> the SQL giving it from one `events` row (a fixed expression, never user input). A
# new per-request figure (a derived one too) is one line here; every report query follows.
# A request's load level (workload, concurrency, target rate) as one number: per-level numbers
# computed outside SQL are matched to SLICE_LEVELS rows by it.
_LEVEL_KEY = "hash(workload, concurrency, target_rate)"

REPORT_LATENCY_METRICS: dict[str, str] = {
    "ttft_ms": "ttft_ms",
    "tpot_ms": "tpot_ms",
    "e2e_ms": "e2e_ms",
    "queue_ms": "queue_ms",
    "prefill_ms": "prefill_ms",
    "decode_ms": "decode_ms",
}
# vLLM's own figures of the client's indicators (name → SQL): TTFT and e2e from its trace, TPOT
# as vLLM defines it (decode time over the output tokens after the first), or as the record says
# (a request served in parts, `store.db._sum_parts`: its samples' mean, where its summed tokens
# would halve it for n = 2). Summarised and bootstrapped like the others; a report shows them,
# or uses them where the client's are absent.
SERVER_LATENCY: dict[str, str] = {
    "server_ttft_ms": "server_ttft_ms",
    "server_tpot_ms": "COALESCE(server_tpot_ms, decode_ms / NULLIF(completion_tokens - 1, 0))",
    "server_e2e_ms": "server_e2e_ms",
}
_PER_REQUEST = {**REPORT_LATENCY_METRICS, **SERVER_LATENCY}
# Goodput bounds ($slo_<metric>, NULL = none): what vLLM's `--goodput` accepts.
SLO_METRICS = ("ttft_ms", "tpot_ms", "e2e_ms")
_GOOD = "status = 'ok' AND " + " AND ".join(
    f"(CAST($slo_{m} AS DOUBLE) IS NULL OR {m} <= $slo_{m})" for m in SLO_METRICS
)

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
    max(ts + to_microseconds(CAST(COALESCE(e2e_ms, server_e2e_ms, 0) * 1000 AS BIGINT)))
        AS last_end_ts,
    sum(prompt_tokens) FILTER (WHERE status = 'ok') AS input_tokens,
    sum(completion_tokens) FILTER (WHERE status = 'ok') AS output_tokens,
    avg(CASE WHEN cache_hit THEN 1.0 WHEN NOT cache_hit THEN 0.0 END) AS cache_hit_request_ratio,
    sum(cached_tokens)::DOUBLE
        / NULLIF(sum(prompt_tokens) FILTER (WHERE cached_tokens IS NOT NULL), 0)
        AS cached_token_ratio,
    avg(prompt_tokens) AS prompt_tokens_mean,
    count(*) FILTER (WHERE GOOD) AS good_requests""".replace("GOOD", _GOOD)

SLICE_OVERALL = _sliced(
    """
SELECT COLUMNS, string_agg(DISTINCT model, ', ' ORDER BY model) AS models
FROM events
WHERE SLICE
"""
).replace("COLUMNS", _SUMMARY_COLUMNS)

SLICE_LEVELS = _sliced(
    """
SELECT workload, concurrency, target_rate, LEVEL_KEY AS level_key, COLUMNS, LATENCY
FROM events
WHERE SLICE
GROUP BY workload, concurrency, target_rate
ORDER BY workload NULLS FIRST, concurrency NULLS FIRST, target_rate NULLS FIRST
"""
)
_LEVEL_LATENCY = ",\n    ".join(
    f"favg({x}) FILTER (WHERE status = 'ok') AS {m}_mean" for m, x in _PER_REQUEST.items()
)
SLICE_LEVELS = (
    SLICE_LEVELS.replace("COLUMNS", _SUMMARY_COLUMNS)
    .replace("LATENCY", _LEVEL_LATENCY)
    .replace("LEVEL_KEY", _LEVEL_KEY)
)

# Means of doubles are `favg` (compensated summation): the correctly rounded mean whatever order
# the rows come in (parallel scans, a lake's files in any order), so the same data gives the
# same report to the last digit from any store or lake that holds it; `avg` sums in row order.
# ITL as `vllm bench serve` pools it: every gap between content chunks of successful requests,
# overall and per level. A slice with few gaps (`reports.quantiles.SMALL`) takes DuckDB's
# quantile aggregate (SLICE_ITL, SLICE_GROUP_ITL: two plain aggregations, faster than grouping
# sets over the gaps). A larger one is not held whole: `reports.quantiles` finds the exact
# order statistics from the count, range and mean overall and per level (SLICE_ITL_STATS,
# SLICE_GROUP_ITL_STATS), a histogram of $buckets equal buckets over [$lo, $hi] per level
# (SLICE_ITL_HISTOGRAM) and the gaps of the buckets holding a wanted rank (SLICE_ITL_GAPS).
# The bucket of a gap is a monotone function of it, so a bucket's gaps are exactly those
# between its min and max. (NaN gaps, which only a hand-written file could hold, sort last as
# in DuckDB.) The level key is hashed once per request, before the gaps are unnested.
SLICE_ITL = _sliced(
    """
SELECT quantile_cont(gap, [0.5, 0.9, 0.95, 0.99]) AS q, favg(gap) AS mean
FROM (SELECT unnest(itl_ms) AS gap FROM events WHERE status = 'ok' AND SLICE)
"""
)
SLICE_GROUP_ITL = _sliced(
    """
SELECT level_key, quantile_cont(gap, [0.5, 0.9, 0.95, 0.99]) AS q, favg(gap) AS mean
FROM (SELECT LEVEL_KEY AS level_key, unnest(itl_ms) AS gap
      FROM events WHERE status = 'ok' AND SLICE)
GROUP BY level_key
""".replace("LEVEL_KEY", _LEVEL_KEY)
)
_GAPS = """
SELECT level_key, gap
FROM (SELECT LEVEL_KEY AS level_key, unnest(itl_ms) AS gap
      FROM events WHERE status = 'ok' AND SLICE)
WHERE gap IS NOT NULL
""".replace("LEVEL_KEY", _LEVEL_KEY)
_GAP_BUCKET = """LEAST(GREATEST(floor((gap - $lo) / $width), 0), $last)::BIGINT"""
# quantile_cont over given values: how this DuckDB build rounds an interpolation
# (`reports.quantiles` repeats it outside SQL).
QUANTILE_PROBE = "SELECT quantile_cont(x, $qs) FROM (SELECT unnest($rows::DOUBLE[]) AS x)"
_ITL_STATS = """count(gap) AS n,
       min(gap) FILTER (WHERE NOT isnan(gap)) AS lo, max(gap) FILTER (WHERE NOT isnan(gap)) AS hi,
       favg(gap) AS mean"""
# (two plain aggregations, as SLICE_ITL and SLICE_GROUP_ITL compute the means: grouping sets
# sum a mean in another order, a last-digit difference)
SLICE_ITL_STATS = _sliced(
    """
SELECT STATS
FROM (SELECT unnest(itl_ms) AS gap FROM events WHERE status = 'ok' AND SLICE)
""".replace("STATS", _ITL_STATS)
)
SLICE_GROUP_ITL_STATS = _sliced(
    """
SELECT level_key, STATS
FROM (SELECT LEVEL_KEY AS level_key, unnest(itl_ms) AS gap
      FROM events WHERE status = 'ok' AND SLICE)
GROUP BY level_key
""".replace("STATS", _ITL_STATS).replace("LEVEL_KEY", _LEVEL_KEY)
)
SLICE_ITL_HISTOGRAM = _sliced(
    """
SELECT level_key, BUCKET AS b, count(*) AS n, min(gap) AS lo, max(gap) AS hi
FROM (GAPS)
WHERE gap BETWEEN $lo AND $hi
GROUP BY ALL
""".replace("GAPS", _GAPS).replace("BUCKET", _GAP_BUCKET)
)
SLICE_ITL_GAPS = _sliced(
    """
SELECT level_key, b, gap
FROM (SELECT level_key, gap, BUCKET AS b FROM (GAPS)
      WHERE gap BETWEEN $lo AND $hi)
WHERE list_contains($buckets, b)
""".replace("GAPS", _GAPS).replace("BUCKET", _GAP_BUCKET)
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

# One latency metric of a slice's successful requests where it was measured (no NULL, no NaN),
# with each request's level key: what the report's quantiles, bootstrap draws and CDFs read,
# fetched one metric at a time (and sorted by numpy, in place: DuckDB's ORDER BY would hold
# twice the memory).
SLICE_METRIC = {
    m: _sliced(
        """
SELECT v, level_key
FROM (SELECT EXPR AS v, LEVEL_KEY AS level_key FROM events WHERE status = 'ok' AND SLICE)
WHERE v IS NOT NULL AND NOT isnan(v)
"""
    )
    .replace("EXPR", x)
    .replace("LEVEL_KEY", _LEVEL_KEY)
    for m, x in _PER_REQUEST.items()
}
# How many successful requests of a slice have each per-request figure (client and server).
_MEASURED = ", ".join(
    f"count(*) FILTER (WHERE ({x}) IS NOT NULL AND NOT isnan({x})) AS {m}"
    for m, x in _PER_REQUEST.items()
)
SLICE_MEASURED = _sliced("SELECT COUNTS FROM events WHERE status = 'ok' AND SLICE").replace(
    "COUNTS", _MEASURED
)

# What the diff needs of a slice besides latencies: request and success counts, cache-hit
# flags, tokens of successful requests (and whether any was measured), the span of start times;
# and for the summary, the levels and how many ITL gaps there are (NULL ones too).
SLICE_SAMPLE_COUNTS = _sliced(
    """
SELECT count(*) AS requests,
       count(*) FILTER (WHERE status = 'ok') AS ok,
       count(cache_hit) AS cache_known,
       count(*) FILTER (WHERE cache_hit) AS cache_hits,
       min(epoch(ts)) AS first_t,
       max(epoch(ts)) AS last_t,
       count(prompt_tokens) FILTER (WHERE status = 'ok') AS input_known,
       count(completion_tokens) FILTER (WHERE status = 'ok') AS output_known,
       COALESCE(sum(prompt_tokens) FILTER (WHERE status = 'ok'), 0)::DOUBLE AS input_tokens,
       COALESCE(sum(completion_tokens) FILTER (WHERE status = 'ok'), 0)::DOUBLE AS output_tokens,
       COALESCE(list(DISTINCT LEVEL_KEY) FILTER (WHERE status = 'ok'), []) AS level_keys,
       COALESCE(sum(len(itl_ms)) FILTER (WHERE status = 'ok'), 0) AS itl_gaps
FROM events WHERE SLICE
"""
).replace("LEVEL_KEY", _LEVEL_KEY)

# Per window of completions: the block bootstrap's units for throughput and goodput. A request
# completes at its start + e2e (its start when e2e is missing); window w holds completions in
# [$t0 + w·$width, $t0 + (w + 1)·$width), the last one everything later. Only non-empty windows
# come back. (The arithmetic is the double arithmetic the report did on fetched columns.)
SLICE_WINDOW_TOTALS = _sliced(
    """
SELECT w,
       count(*) FILTER (WHERE status = 'ok')::DOUBLE AS ok,
       COALESCE(sum(prompt_tokens) FILTER (WHERE status = 'ok'), 0)::DOUBLE AS input_tokens,
       COALESCE(sum(completion_tokens) FILTER (WHERE status = 'ok'), 0)::DOUBLE AS output_tokens,
       count(*) FILTER (WHERE GOOD)::DOUBLE AS good
FROM (
    SELECT *, LEAST(GREATEST(floor(
               (epoch(ts) + COALESCE(CASE WHEN isnan(e2e_ms) THEN 0 ELSE e2e_ms END, 0)
                   / 1000.0::DOUBLE - $t0) / $width), 0), $last)::BIGINT AS w
    FROM events WHERE ts IS NOT NULL AND SLICE
)
GROUP BY w
"""
).replace("GOOD", _GOOD)

# Successful requests' TTFT by start time, for the chart: their count and time span
# (SLICE_TTFT_SPAN), then every point (SLICE_TTFT_POINTS) or the median per time bucket of
# $width seconds from $t0, the last bucket closed (SLICE_TTFT_BUCKETS).
_TTFT_TIMED = """
SELECT epoch(ts) AS t, ttft_ms FROM events
WHERE status = 'ok' AND ts IS NOT NULL AND ttft_ms IS NOT NULL AND NOT isnan(ttft_ms) AND SLICE
"""
SLICE_TTFT_SPAN = _sliced(
    "SELECT count(*), min(t), max(t) FROM (TIMED)".replace("TIMED", _TTFT_TIMED)
)
SLICE_TTFT_POINTS = _sliced(
    "SELECT t, ttft_ms FROM (TIMED) ORDER BY t".replace("TIMED", _TTFT_TIMED)
)
SLICE_TTFT_BUCKETS = _sliced(
    """
SELECT LEAST(floor((t - $t0) / $width), $last)::BIGINT AS b, median(ttft_ms) AS ttft_ms
FROM (TIMED) GROUP BY b ORDER BY b
""".replace("TIMED", _TTFT_TIMED)
)

# The seeds' pass criteria that need the events themselves. Chat calls are the requests of the
# workloads the run's spec sends to the chat endpoint ($chat_workloads), and those vLLM named
# itself as chat completions (a server session's requests: no client id, no spec; or refused on
# the chat path). The latency is the client's, or vLLM's own where no client measured it.
SLICE_CHECKS = _sliced(
    """
SELECT
    count(*) AS requests,
    count(*) FILTER (WHERE status = 'timeout' OR error = 'timeout') AS timeouts,
    count(*) FILTER (WHERE status = 'ok') AS ok,
    count(*) FILTER (
        WHERE status = 'ok' AND (model IS NULL OR prompt_tokens IS NULL
              OR completion_tokens IS NULL OR COALESCE(e2e_ms, server_e2e_ms) IS NULL)
    ) AS ok_missing_fields,
    count(*) FILTER (WHERE CHAT) AS chat_requests,
    count(*) FILTER (WHERE status = 'ok' AND CHAT) AS chat_ok
FROM events WHERE SLICE
""".replace(
        "CHAT",
        "(list_contains($chat_workloads, workload) OR starts_with(request_id, 'chatcmpl-') OR "
        # the collector keys a session's request by the id inside vLLM's (`chatcmpl-R` → R) and
        # keeps vLLM's in the doc; a refused call is known by its access line's path. Only a
        # session's slice reads `doc`: for any other run the condition folds away.
        f"({_SESSION_RUN} AND (starts_with(doc->>'vllm_request_id', 'chatcmpl-') "
        "OR doc->>'http_path' = '/v1/chat/completions')))",
    )
)

# Out-of-memory failures: the error class or the kept message says so (failed requests only).
SLICE_OOMS = _sliced(
    """
SELECT count(*) AS ooms
FROM events
WHERE status <> 'ok' AND SLICE
  AND regexp_matches(COALESCE(error, '') || ' ' || COALESCE(error_detail, ''),
                     '(?i)out of memory|\\bOOM\\b|OutOfMemory')
"""
)

# How much a counter grew: per series (target, labels) the sum of its steps between successive
# samples, a drop meaning the server restarted (the new value counts whole). A server session's
# run (`vllm-…`) holds one process's samples, whose counters began at 0 with it: there the first
# sample counts whole too, so a session short enough to be scraped once is still measured.
# `steps` counts the steps taken: 0 is "not measured", never "zero".
_STEP = """CASE WHEN prev IS NULL THEN FIRST
            WHEN value >= prev THEN value - prev
            ELSE value END"""
_COUNTER_GROWTH = "sum(step) AS delta, count(step) AS steps"


_SLICE_COUNTERS = """
WITH s AS (
    SELECT target, labels, name, ts, value,
           lag(value) OVER (PARTITION BY target, name, labels ORDER BY ts) AS prev
    FROM metric_samples
    WHERE run_id = $run_id AND NAMES
),
steps AS (SELECT *, STEP AS step FROM s WHERE true WINDOW)
SELECT KEYS, GROWTH FROM steps GROUP BY ALL
"""


def _slice_counters(names: str, keys: str) -> str:
    """Counter growth over a slice, grouped by `keys`: steps are taken over the run's samples,
    then kept when they end inside the window, so a window's first step starts before it."""
    first = "CASE WHEN " + _SESSION_RUN + " THEN value END"
    return (
        _SLICE_COUNTERS.replace("NAMES", names)
        .replace("STEP", _STEP.replace("FIRST", first))
        .replace("WINDOW", _IN_WINDOW)
        .replace("KEYS", keys)
        .replace("GROWTH", _COUNTER_GROWTH)
    )


SLICE_COUNTER_DELTAS = _slice_counters("list_contains($names, name)", "name")

SLICE_GAUGE_PEAKS = _samples_sliced(
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

# A run's successful requests, and how many of them carry vLLM's own timings (its trace).
TRACED_REQUESTS = """
SELECT count(*), count(server_ttft_ms) FROM events WHERE run_id = $run_id AND status = 'ok'
"""
# A run's first and last request (a session's own and those it served for client runs).
RUN_SPAN = """
SELECT min(ts), max(ts) FROM events WHERE run_id = $run_id OR vllm_session = $run_id
"""
# The run before one on the same server (a session's predecessor when its notes do not say).
PREVIOUS_RUN = """
SELECT run_id FROM runs
WHERE target = $target AND started_at < $started AND run_id <> $run_id
ORDER BY started_at DESC LIMIT 1
"""
# `report flips`: every lever flip, grouped by the change of runs it belongs to.
FLIP_LIST = """
SELECT min(ts) AS ts, run_id, before_run_id,
       list({'lever': lever, 'before': before, 'after': after} ORDER BY lever) AS changes,
       any_value(note) AS note
FROM lever_flips GROUP BY run_id, before_run_id ORDER BY min(ts), run_id
"""

RUN_LEVER_FLIPS = """
SELECT ts, lever, before, after, note FROM lever_flips WHERE run_id = $run_id ORDER BY ts, lever
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
# an object). `{ok}` (store/bulk.py, from the contract) is stricter than `store.validation.check`,
# so every line it accepts `check` accepts too; such a line is inserted when its request is not
# stored yet, with the typed columns of INSERT_STAGED_EVENTS computed from the same parse.
BULK_INSERT = """
INSERT INTO events (COLUMNS)
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
    TRY_CAST(http_status::VARCHAR AS INTEGER), error->>'$', trace_id->>'$', line,
    TRY_CAST(server_ttft_ms::VARCHAR AS DOUBLE), TRY_CAST(server_e2e_ms::VARCHAR AS DOUBLE),
    vllm_session->>'$', error_detail->>'$', TRY_CAST(server_tpot_ms::VARCHAR AS DOUBLE)
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
""".replace("COLUMNS", EVENT_COLUMNS)
# A request on several lines of one chunk is merged by the ordinary path: its rows go again.
# By the key's hash, which groups several times faster than the two strings: a collision only
# sends a request the statement had written to the ordinary path (`BULK_REST` finds its line).
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

# A slice's request shape, for the diagnosis's workload classification: token quantiles of
# successful requests and the multi-turn sessions bench records (`session`, `turn` keys).
SLICE_SHAPE = _sliced(
    """
SELECT approx_quantile(prompt_tokens, [0.5, 0.95]) FILTER (WHERE status = 'ok') AS prompt_q,
       approx_quantile(completion_tokens, [0.5, 0.95]) FILTER (WHERE status = 'ok') AS output_q
FROM events WHERE SLICE
"""
)

# -- speculative decoding: vLLM's spec_decode counters over a slice, and per workload ----------
# `position` is the label of vllm:spec_decode_num_accepted_tokens_per_pos_total (NULL for the
# other counters).
SLICE_SPEC_DECODE = _slice_counters(
    "starts_with(name, 'vllm:spec_decode_')", "name, CAST(labels AS JSON)->>'position' AS position"
)

# Per workload of a slice: from the run's last sample at or before the workload's first request
# to its first sample at or after the workload's last request ended. The bench scrapes at each
# level's end, so workloads that run one after another split exactly; with samples only every
# second (a collector's scrape) a window may take in up to a second of its neighbours.
SLICE_SPEC_DECODE_BY_WORKLOAD = _sliced(
    """
WITH w AS (
    SELECT workload, min(ts) AS first_ts,
           max(ts + to_microseconds(CAST(COALESCE(e2e_ms, 0) * 1000 AS BIGINT))) AS last_end
    FROM events
    WHERE SLICE AND workload IS NOT NULL
    GROUP BY workload
),
m AS (
    SELECT target, labels, name, ts, value
    FROM metric_samples
    WHERE run_id = $run_id AND starts_with(name, 'vllm:spec_decode_')
),
b AS (
    SELECT workload,
           (SELECT max(ts) FROM m WHERE m.ts <= w.first_ts) AS lo,
           (SELECT min(ts) FROM m WHERE m.ts >= w.last_end) AS hi
    FROM w
),
s AS (
    SELECT b.workload, m.target, m.labels, m.name, m.ts, m.value,
           lag(m.value) OVER (PARTITION BY b.workload, m.target, m.name, m.labels
                              ORDER BY m.ts) AS prev
    FROM b JOIN m ON m.ts BETWEEN b.lo AND b.hi
)
SELECT workload, name, CAST(labels AS JSON)->>'position' AS position, GROWTH
FROM (SELECT *, STEP AS step FROM s) GROUP BY ALL
ORDER BY min(ts), workload
""".replace("GROWTH", _COUNTER_GROWTH).replace("STEP", _STEP.replace("FIRST", "NULL"))
)

# Each workload's successful TPOTs, sorted: the speculative-decoding diff tests TPOT per workload
# (drafts accepted on one, rejected on another: a pooled TPOT hides both).
SLICE_WORKLOAD_TPOT = _sliced(
    """
SELECT workload, list(tpot_ms ORDER BY tpot_ms) AS tpot_ms
FROM events
WHERE SLICE AND status = 'ok' AND tpot_ms IS NOT NULL AND workload IS NOT NULL
GROUP BY workload
"""
)
