"""Every SQL statement of the reports, in one place.

A report describes a slice of a run: the whole run, or the part of it before/after a lever flip
(or in a `--since`/`--until` window). Every slice statement takes $run_id, $since and $until
(NULL = unbounded; events without a `ts` belong only to an unbounded slice), so one set of
statements serves a summary, `--vs` and `--split-at-flip`. Values are bound parameters; the
statements are composed from the named fragments below. Counter growth, gauge peaks and the
session-run rule are the store's (`store.queries`), shared with its own run-scoped reads.
"""

from __future__ import annotations

from datetime import datetime
from typing import TypedDict

from servescope.store.queries import (
    counter_deltas,
    counter_growth,
    counter_step,
    gauge_peaks,
    session_run,
)
from servescope.wire.slo import SLO_METRICS


class SliceParams(TypedDict):
    """A slice as the `SLICE_*` statements bind it: `$run_id`, `$since`, `$until`."""

    run_id: str
    since: datetime | None
    until: datetime | None


# -- a slice ----------------------------------------------------------------------------------
IN_WINDOW = """
    AND (CAST($since AS TIMESTAMP) IS NULL OR ts >= CAST($since AS TIMESTAMP))
    AND (CAST($until AS TIMESTAMP) IS NULL OR ts < CAST($until AS TIMESTAMP))"""
# A server session's run also holds the requests it served for client runs (`vllm_session`);
# for any other run the test folds away, so a bench run's slice reads no more than its own rows.
IN_SLICE = f"(run_id = $run_id OR ({session_run()} AND vllm_session = $run_id))" + IN_WINDOW
SAMPLES_IN_SLICE = "run_id = $run_id" + IN_WINDOW

# A request's load level (workload, concurrency, target rate) as one number: per-level numbers
# computed outside SQL are matched to SLICE_LEVELS rows by it.
LEVEL_KEY = "hash(workload, concurrency, target_rate)"

# The per-request latencies a report summarises (overall and per level), bootstraps and draws:
# name -> the SQL giving it from one `events` row (a fixed expression, never user input). A
# new per-request figure (a derived one too) is one line here; every report query follows.
# A stream whose tokens all arrived at once (one chunk, or chunks of one read: every gap 0)
# carries no client TPOT (events stored before the client stopped writing one have it near 0):
# left out, and counted (`one_chunk` of SLICE_MEASURED).
ONE_CHUNK = "(completion_tokens > 1 AND itl_ms IS NOT NULL AND COALESCE(list_max(itl_ms), 0) <= 0)"
REPORT_LATENCY_METRICS: dict[str, str] = {
    "ttft_ms": "ttft_ms",
    "tpot_ms": f"CASE WHEN {ONE_CHUNK} THEN NULL ELSE tpot_ms END",
    "e2e_ms": "e2e_ms",
    "queue_ms": "queue_ms",
    "prefill_ms": "prefill_ms",
    "decode_ms": "decode_ms",
}
# vLLM's own figures of the client's indicators (name → SQL): TTFT and e2e from its trace, TPOT
# as vLLM defines it (decode time over the output tokens after the first), or as the record says
# (a request served in parts, `store.merge._sum_parts`: its samples' mean, where its summed
# tokens would halve it for n = 2). Summarised and bootstrapped like the others; a report shows
# them, or uses them where the client's are absent.
SERVER_LATENCY: dict[str, str] = {
    "server_ttft_ms": "server_ttft_ms",
    "server_tpot_ms": "COALESCE(server_tpot_ms, decode_ms / NULLIF(completion_tokens - 1, 0))",
    "server_e2e_ms": "server_e2e_ms",
}
_PER_REQUEST = {**REPORT_LATENCY_METRICS, **SERVER_LATENCY}
# Goodput bounds ($slo_<metric>, NULL = none): what vLLM's `--goodput` accepts.
# A request with no TPOT (one output token, or one chunk) is not held to the TPOT bound.
_GOOD = "status = 'ok' AND " + " AND ".join(
    f"(CAST($slo_{m} AS DOUBLE) IS NULL OR {m} <= $slo_{m}"
    + (f" OR {m} IS NULL OR {ONE_CHUNK}" if m == "tpot_ms" else "")
    + ")"
    for m in SLO_METRICS
)

# -- summary: counts, tokens, goodput, per-level latencies -------------------------------------
# A slice's counts, tokens and goodput (SLICE_OVERALL), and the same per load level with the
# latency means (SLICE_LEVELS). The quantiles come from the per-request samples the report
# sorts for its bootstrap anyway (`reports.samples`, SLICE_METRIC), per level too.
# Goodput (vLLM's definition): successful requests meeting every SLO given ($slo_* NULL = none).
_SUMMARY_COLUMNS = f"""
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
    count(*) FILTER (WHERE {_GOOD}) AS good_requests"""

SLICE_OVERALL = f"""
SELECT {_SUMMARY_COLUMNS}, string_agg(DISTINCT model, ', ' ORDER BY model) AS models
FROM events
WHERE {IN_SLICE}
"""

_LEVEL_LATENCY = ",\n    ".join(
    f"favg({x}) FILTER (WHERE status = 'ok') AS {m}_mean" for m, x in _PER_REQUEST.items()
)
SLICE_LEVELS = f"""
SELECT workload, concurrency, target_rate, {LEVEL_KEY} AS level_key, {_SUMMARY_COLUMNS},
    {_LEVEL_LATENCY}
FROM events
WHERE {IN_SLICE}
GROUP BY workload, concurrency, target_rate
ORDER BY workload NULLS FIRST, concurrency NULLS FIRST, target_rate NULLS FIRST
"""

# Means of doubles are `favg` (compensated summation): the correctly rounded mean whatever order
# the rows come in (parallel scans, a lake's files in any order), so the same requests give the
# same report to the last digit from any store or lake that holds them; `avg` sums in row order.

# -- pooled ITL (reports/quantiles.py) ---------------------------------------------------------
# ITL as `vllm bench serve` pools it: every gap between content chunks of successful requests,
# overall and per level. A slice of up to `reports.quantiles.IN_MEMORY` gaps fetches them once
# with their level's place in $levels (SLICE_LEVEL_GAPS), and `reports.quantiles` partially
# sorts them. A larger one is not held whole:
# `reports.quantiles` finds the exact order statistics from the count, range and mean overall
# and per level (SLICE_ITL_STATS, SLICE_GROUP_ITL_STATS), a histogram of $buckets equal buckets
# over [$lo, $hi] per level (SLICE_ITL_HISTOGRAM) and the gaps of the buckets holding a wanted
# rank (SLICE_ITL_GAPS). The bucket of a gap is a monotone function of it, so a bucket's gaps
# are exactly those between its min and max. (NaN gaps, which only a hand-written file could
# hold, sort last as in DuckDB.) The level key is hashed once per request, before the gaps are
# unnested.
_OK_GAPS = f"SELECT unnest(itl_ms) AS gap FROM events WHERE status = 'ok' AND {IN_SLICE}"
_OK_LEVEL_GAPS = f"""SELECT {LEVEL_KEY} AS level_key, unnest(itl_ms) AS gap
      FROM events WHERE status = 'ok' AND {IN_SLICE}"""
SLICE_LEVEL_GAPS = f"""
SELECT CAST(list_position($levels, {LEVEL_KEY}) AS UINTEGER) AS level, unnest(itl_ms) AS gap
FROM events WHERE status = 'ok' AND {IN_SLICE}
"""
_GAPS = f"""
SELECT level_key, gap
FROM ({_OK_LEVEL_GAPS})
WHERE gap IS NOT NULL
"""
_GAP_BUCKET = """LEAST(GREATEST(floor((gap - $lo) / $width), 0), $last)::BIGINT"""
# quantile_cont over given values: how this DuckDB build rounds an interpolation
# (`reports.quantiles` repeats it outside SQL).
QUANTILE_PROBE = "SELECT quantile_cont(x, $qs) FROM (SELECT unnest($rows::DOUBLE[]) AS x)"
_ITL_STATS = """count(gap) AS n,
       min(gap) FILTER (WHERE NOT isnan(gap)) AS lo, max(gap) FILTER (WHERE NOT isnan(gap)) AS hi,
       favg(gap) AS mean"""
SLICE_ITL_STATS = f"""
SELECT {_ITL_STATS}
FROM ({_OK_GAPS})
"""
SLICE_GROUP_ITL_STATS = f"""
SELECT level_key, {_ITL_STATS}
FROM ({_OK_LEVEL_GAPS})
GROUP BY level_key
"""
SLICE_ITL_HISTOGRAM = f"""
SELECT level_key, {_GAP_BUCKET} AS b, count(*) AS n, min(gap) AS lo, max(gap) AS hi
FROM ({_GAPS})
WHERE gap BETWEEN $lo AND $hi
GROUP BY ALL
"""
SLICE_ITL_GAPS = f"""
SELECT level_key, b, gap
FROM (SELECT level_key, gap, {_GAP_BUCKET} AS b FROM ({_GAPS})
      WHERE gap BETWEEN $lo AND $hi)
WHERE list_contains($buckets, b)
"""

# -- failures and admission --------------------------------------------------------------------
SLICE_ERRORS_BY_CLASS = f"""
SELECT workload, concurrency, target_rate, COALESCE(error, status) AS class, count(*) AS n
FROM events WHERE status <> 'ok' AND {IN_SLICE}
GROUP BY ALL ORDER BY n DESC, class
"""

# Admission rejections: the gateway writes `status = rejected`, `error = rejected:<reason>`.
SLICE_REJECTIONS = f"""
SELECT team, COALESCE(NULLIF(regexp_extract(error, '^rejected:(.*)$', 1), ''), error, 'unknown')
           AS reason,
       count(*) AS n
FROM events WHERE status = 'rejected' AND {IN_SLICE}
GROUP BY ALL ORDER BY team NULLS LAST, reason
"""

# Per team: what admission control did to each tenant (isolation evidence).
SLICE_TEAMS = f"""
SELECT team, count(*) AS requests,
       count(*) FILTER (WHERE status = 'ok') AS ok,
       count(*) FILTER (WHERE status = 'rejected') AS rejected,
       count(*) FILTER (WHERE status NOT IN ('ok', 'rejected')) AS failed,
       quantile_cont(queue_ms, 0.95) FILTER (WHERE status = 'ok') AS queue_ms_p95,
       count(*) FILTER (WHERE status = 'rejected' AND NOT starts_with(COALESCE(error, ''),
                                                                 'rejected:'))
           AS rejected_without_reason
FROM events WHERE team IS NOT NULL AND {IN_SLICE}
GROUP BY team ORDER BY team
"""

# -- per-request samples (reports/samples.py) --------------------------------------------------
# One latency metric of a slice's successful requests where it was measured (no NULL, no NaN),
# with each request's level key: what the report's quantiles, bootstrap draws and CDFs read,
# fetched one metric at a time (and sorted by numpy, in place: DuckDB's ORDER BY would hold
# twice the memory).
SLICE_METRIC = {
    m: f"""
SELECT v, level_key
FROM (SELECT {x} AS v, {LEVEL_KEY} AS level_key FROM events WHERE status = 'ok' AND {IN_SLICE})
WHERE v IS NOT NULL AND NOT isnan(v)
"""
    for m, x in _PER_REQUEST.items()
}
# How many successful requests of a slice have each per-request figure (client and server).
_MEASURED = ", ".join(
    f"count(*) FILTER (WHERE ({x}) IS NOT NULL AND NOT isnan({x})) AS {m}"
    for m, x in _PER_REQUEST.items()
)
SLICE_LEVEL_KEYS = f"""
SELECT DISTINCT workload, concurrency, target_rate, {LEVEL_KEY} AS level_key
FROM events WHERE status = 'ok' AND {IN_SLICE}
"""
SLICE_MEASURED = f"""
SELECT {_MEASURED}, count(*) FILTER (WHERE {ONE_CHUNK}) AS one_chunk,
       count(*) FILTER (WHERE completion_tokens > 1) AS multi_token
FROM events WHERE status = 'ok' AND {IN_SLICE}
"""

# What the diff needs of a slice besides latencies: request and success counts, cache-hit
# flags, tokens of successful requests (and whether any was measured), the span of start times;
# and for the summary, the levels and how many ITL gaps there are (NULL ones too).
SLICE_SAMPLE_COUNTS = f"""
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
       COALESCE(list(DISTINCT {LEVEL_KEY}) FILTER (WHERE status = 'ok'), []) AS level_keys,
       COALESCE(sum(len(itl_ms)) FILTER (WHERE status = 'ok'), 0) AS itl_gaps
FROM events WHERE {IN_SLICE}
"""

# Per window of the run: the block bootstrap's units for throughput, goodput and energy per
# token. Each successful request is counted where its work happened, spread evenly over a span:
# the request itself (`ok`, `good`) over its life, start → start + e2e; its prompt tokens over
# prefill, start → first token; its output tokens over decode, first token → end. Counted at
# completion instead, a batch that finishes together would put a run's whole throughput into a
# few windows, and resampling windows would measure when batches end, not how fast the server
# serves. Positions are in windows from $t0 (`$count` of width `$width`), clamped to the run; a
# span shorter than 1/1000 of a window is widened to that. Per column and window edge `k`, the
# rows are the changes of the rate (amount per window) of the spans under way and of
# Σ rate · start, and the amounts of spans ended: `Samples.window_totals` sums them up to each
# edge, where the amount done is ended + k · Σ rate − Σ rate · start, and each window's total
# is the difference between its edges. Aggregated in SQL: memory grows with the windows, not
# the requests.
SLICE_WINDOW_TOTALS = f"""
WITH req AS MATERIALIZED (
    SELECT epoch(ts) AS s,
           epoch(ts) + COALESCE(CASE WHEN isnan(e2e_ms) THEN NULL ELSE e2e_ms END, 0)
               / 1000.0::DOUBLE AS e,
           COALESCE(prompt_tokens, 0)::DOUBLE AS input_tokens,
           COALESCE(completion_tokens, 0)::DOUBLE AS output_tokens,
           CASE WHEN ttft_ms IS NULL OR isnan(ttft_ms) THEN NULL ELSE ttft_ms END AS ttft_ms,
           COALESCE({_GOOD}, false) AS good
    FROM events WHERE ts IS NOT NULL AND status = 'ok' AND {IN_SLICE}
), timed AS (
    SELECT *, LEAST(GREATEST(s + COALESCE(ttft_ms, 0) / 1000.0::DOUBLE, s), e) AS f FROM req
), spans AS (
    SELECT 'ok' AS col, s AS a, e AS b, 1.0::DOUBLE AS amount FROM timed
    UNION ALL SELECT 'good', s, e, 1.0 FROM timed WHERE good
    UNION ALL SELECT 'input_tokens', s, f, input_tokens FROM timed
    UNION ALL SELECT 'output_tokens', f, e, output_tokens FROM timed
), placed AS (
    SELECT col, amount, pa, GREATEST(pb, pa + 0.001) AS pb FROM (
        SELECT col, amount,
               LEAST(GREATEST((a - $t0) / $width, 0), $count - 0.001) AS pa,
               LEAST(GREATEST((b - $t0) / $width, 0), $count) AS pb
        FROM spans
    )
), edges AS (
    SELECT col, amount, pa, floor(pa)::BIGINT + 1 AS ka, ceil(pb)::BIGINT AS kb,
           amount / (pb - pa) AS rate
    FROM placed
)
SELECT col, ka AS k, sum(rate) AS rate, sum(rate * pa) AS rate_start, 0.0::DOUBLE AS ended
FROM edges WHERE ka < kb GROUP BY ALL
UNION ALL
SELECT col, kb AS k,
       -COALESCE(sum(rate) FILTER (WHERE ka < kb), 0),
       -COALESCE(sum(rate * pa) FILTER (WHERE ka < kb), 0),
       sum(amount)
FROM edges GROUP BY ALL
"""

# Successful requests' TTFT by start time, for the chart: their count and time span
# (SLICE_TTFT_SPAN), then every point (SLICE_TTFT_POINTS) or the median per time bucket of
# $width seconds from $t0, the last bucket closed (SLICE_TTFT_BUCKETS).
_TTFT_TIMED = f"""
SELECT epoch(ts) AS t, ttft_ms FROM events
WHERE status = 'ok' AND ts IS NOT NULL AND ttft_ms IS NOT NULL AND NOT isnan(ttft_ms) AND {IN_SLICE}
"""
SLICE_TTFT_SPAN = f"SELECT count(*), min(t), max(t) FROM ({_TTFT_TIMED})"
SLICE_TTFT_POINTS = f"SELECT t, ttft_ms FROM ({_TTFT_TIMED}) ORDER BY t"
SLICE_TTFT_BUCKETS = f"""
SELECT LEAST(floor((t - $t0) / $width), $last)::BIGINT AS b, median(ttft_ms) AS ttft_ms
FROM ({_TTFT_TIMED}) GROUP BY b ORDER BY b
"""

# -- the checklist (reports/checklist.py) ------------------------------------------------------
# The pass criteria that need the events themselves. Chat calls are the requests of the
# workloads the run's spec sends to the chat endpoint ($chat_workloads), and those vLLM named
# itself as chat completions (a server session's requests: no client id, no spec; or refused on
# the chat path): the collector keys a session's request by the id inside vLLM's
# (`chatcmpl-R` → R) and keeps vLLM's in the doc; a refused call is known by its access line's
# path. Only a session's slice reads `doc`: for any other run the condition folds away. The
# latency is the client's, or vLLM's own where no client measured it.
_CHAT = (
    "(list_contains($chat_workloads, workload) OR starts_with(request_id, 'chatcmpl-') OR "
    f"({session_run()} AND (starts_with(doc->>'vllm_request_id', 'chatcmpl-') "
    "OR doc->>'http_path' = '/v1/chat/completions')))"
)
SLICE_CHECKS = f"""
SELECT
    count(*) AS requests,
    count(*) FILTER (WHERE status = 'timeout' OR error = 'timeout') AS timeouts,
    count(*) FILTER (WHERE status = 'ok') AS ok,
    count(*) FILTER (
        WHERE status = 'ok' AND (model IS NULL OR prompt_tokens IS NULL
              OR completion_tokens IS NULL OR COALESCE(e2e_ms, server_e2e_ms) IS NULL)
    ) AS ok_missing_fields,
    count(*) FILTER (WHERE {_CHAT}) AS chat_requests,
    count(*) FILTER (WHERE status = 'ok' AND {_CHAT}) AS chat_ok
FROM events WHERE {IN_SLICE}
"""

# Out-of-memory failures: the error class or the kept message says so (failed requests only).
SLICE_OOMS = f"""
SELECT count(*) AS ooms
FROM events
WHERE status <> 'ok' AND {IN_SLICE}
  AND regexp_matches(COALESCE(error, '') || ' ' || COALESCE(error_detail, ''),
                     '(?i)out of memory|\\bOOM\\b|OutOfMemory')
"""

# -- server side: `/metrics` samples of the slice ----------------------------------------------
SLICE_COUNTER_DELTAS = counter_deltas("list_contains($names, name)", "name", IN_WINDOW)
SLICE_GAUGE_PEAKS = gauge_peaks(f"list_contains($names, name) AND {SAMPLES_IN_SLICE}")

# A slice's request shape, for the diagnosis's workload classification: token quantiles of
# successful requests.
SLICE_SHAPE = f"""
SELECT approx_quantile(prompt_tokens, [0.5, 0.95]) FILTER (WHERE status = 'ok') AS prompt_q,
       approx_quantile(completion_tokens, [0.5, 0.95]) FILTER (WHERE status = 'ok') AS output_q
FROM events WHERE {IN_SLICE}
"""

# -- speculative decoding: vLLM's spec_decode counters over a slice, and per workload ----------
# `position` is the label of vllm:spec_decode_num_accepted_tokens_per_pos_total (NULL for the
# other counters).
_SPEC_DECODE = "starts_with(name, 'vllm:spec_decode_')"
_POSITION = "CAST(labels AS JSON)->>'position' AS position"
SLICE_SPEC_DECODE = counter_deltas(_SPEC_DECODE, f"name, {_POSITION}", IN_WINDOW)

# Per workload of a slice: from the run's last sample at or before the workload's first request
# to the sample where the next workload's window starts, or, for the last workload, the slice's
# last sample: vLLM counts a step's drafts a moment after its tokens reach the client, so a
# window closed at the last response would lose the final steps. The bench scrapes at each
# level's end, so workloads that run one after another split exactly and sum to the run's total;
# workloads that overlap end at the first sample after their last request (with samples only
# every second, a collector's scrape, a window may take in up to a second of its neighbours).
SLICE_SPEC_DECODE_BY_WORKLOAD = f"""
WITH w AS (
    SELECT workload, min(ts) AS first_ts,
           max(ts + to_microseconds(CAST(COALESCE(e2e_ms, 0) * 1000 AS BIGINT))) AS last_end
    FROM events
    WHERE {IN_SLICE} AND workload IS NOT NULL
    GROUP BY workload
),
o AS (SELECT *, lead(first_ts) OVER (ORDER BY first_ts, workload) AS next_ts FROM w),
m AS (
    SELECT target, labels, name, ts, value
    FROM metric_samples
    WHERE run_id = $run_id AND {_SPEC_DECODE}
),
b AS (
    SELECT workload,
           (SELECT max(ts) FROM m WHERE m.ts <= o.first_ts) AS lo,
           CASE
               WHEN o.next_ts IS NULL THEN coalesce(
                   (SELECT max(ts) FROM m
                    WHERE CAST($until AS TIMESTAMP) IS NULL OR m.ts < CAST($until AS TIMESTAMP)),
                   (SELECT min(ts) FROM m WHERE m.ts >= o.last_end))
               WHEN o.next_ts >= o.last_end THEN (SELECT max(ts) FROM m WHERE m.ts <= o.next_ts)
               ELSE (SELECT min(ts) FROM m WHERE m.ts >= o.last_end)
           END AS hi
    FROM o
),
s AS (
    SELECT b.workload, m.target, m.labels, m.name, m.ts, m.value,
           lag(m.value) OVER (PARTITION BY b.workload, m.target, m.name, m.labels
                              ORDER BY m.ts) AS prev
    FROM b JOIN m ON m.ts BETWEEN b.lo AND b.hi
)
SELECT workload, name, {_POSITION}, {counter_growth()}
FROM (SELECT *, {counter_step("NULL")} AS step FROM s) GROUP BY ALL
ORDER BY min(ts), workload
"""

# Each workload's successful TPOTs, sorted, from the figure the diff reads TPOT from (the client's
# or vLLM's): the speculative-decoding diff tests TPOT per workload (drafts accepted on one,
# rejected on another: a pooled TPOT hides both).
SLICE_WORKLOAD_TPOT = {
    figure: f"""
SELECT workload, list(v ORDER BY v) AS tpot_ms
FROM (SELECT workload, {_PER_REQUEST[figure]} AS v FROM events
      WHERE {IN_SLICE} AND status = 'ok' AND workload IS NOT NULL)
WHERE v IS NOT NULL AND NOT isnan(v)
GROUP BY workload
"""
    for figure in ("tpot_ms", "server_tpot_ms")
}

# -- runs and flips (reports/build.py, `report flips`) -----------------------------------------
# Flips a report marks: those recorded for the runs, or unattributed ones inside their span.
REPORT_LEVER_FLIPS = """
SELECT ts, epoch(ts) AS t, lever, before, after, note, run_id
FROM lever_flips
WHERE list_contains($run_ids, run_id)
   OR (run_id IS NULL AND ts BETWEEN CAST($start AS TIMESTAMP) AND CAST($end AS TIMESTAMP))
ORDER BY ts, lever
"""
# A run's first and last request (a session's own and those it served for client runs).
RUN_SPAN = """
SELECT min(ts), max(ts) FROM events WHERE run_id = $run_id OR vllm_session = $run_id
"""
# The run before one on the same server (a session's predecessor when its notes do not say).
# the run before at the same target URL, of the same collector instance (`notes.instance`: two
# hosts' servers on one port share a target such as http://127.0.0.1:8000); a run of no instance
# (a bench run, a session named before instances) precedes only runs of none, and runs that
# are not server sessions (bench runs against the server)
PREVIOUS_RUN = """
SELECT run_id FROM runs
WHERE target = $target AND started_at < $started AND run_id <> $run_id
  AND (json_extract_string(notes, '$.instance') IS NOT DISTINCT FROM $instance
       OR (json_extract_string(notes, '$.instance') IS NULL
           AND coalesce(json_extract_string(notes, '$.kind'), '') <> 'vllm-session'))
ORDER BY started_at DESC LIMIT 1
"""
RUN_LEVER_FLIPS = """
SELECT ts, lever, before, after, note FROM lever_flips WHERE run_id = $run_id ORDER BY ts, lever
"""


# -- a server's cold start and the GPU (reports/coldstart.py, reports/gpu.py) -----------------
# The GPU samples (dcgm-exporter's names) of a slice's window, $lo..$hi in epoch seconds: the
# run's, those of the sessions that served it, and those of no session (servers sharing GPUs).
GPU_SAMPLES = """
SELECT epoch(ts) AS t, target, name, labels, value
FROM metric_samples
WHERE name IN ($power, $energy, $fb_used, $gpu_util)
  AND epoch(ts) BETWEEN $lo AND $hi
  AND (run_id IS NULL OR run_id = $run_id
       OR run_id IN (SELECT DISTINCT vllm_session FROM events
                     WHERE run_id = $run_id AND vllm_session IS NOT NULL))
ORDER BY t
"""


# A fleet run's GPU energy by replica (reports/gpu.py): each replica's server sessions, counts
# and span; the sessions at a replica's URL when its events name none; the GPU samples that
# those sessions own (no session's samples are a shared GPU's: no replica's).
REPLICA_SESSIONS = f"""
SELECT doc->>'upstream' AS replica,
       list(DISTINCT vllm_session) FILTER (WHERE vllm_session IS NOT NULL) AS sessions,
       count(*) FILTER (WHERE status = 'ok') AS ok,
       sum(completion_tokens) FILTER (WHERE status = 'ok') AS output_tokens,
       min(epoch(ts)) AS first_t,
       max(epoch(ts) + COALESCE(e2e_ms, 0) / 1000.0) AS last_t
FROM events WHERE run_id = $run_id AND doc->>'upstream' IS NOT NULL {IN_WINDOW}
GROUP BY ALL ORDER BY replica
"""
SESSIONS_AT_TARGET = """
SELECT run_id FROM runs
WHERE target = $target AND epoch(started_at) <= $hi
  AND (ended_at IS NULL OR epoch(ended_at) >= $lo)
"""
GPU_SAMPLES_OF_RUNS = """
SELECT epoch(ts) AS t, target, name, labels, value
FROM metric_samples
WHERE name IN ($power, $energy, $fb_used, $gpu_util)
  AND epoch(ts) BETWEEN $lo AND $hi
  AND list_contains($runs::VARCHAR[], run_id)
ORDER BY t
"""


# -- a fleet run by replica (reports/replicas.py) ---------------------------------------------
# Is it a fleet run? Its first events carry routing decisions (`store.reads.is_routed`,
# shared with the lake reader).
# Per replica (the event's `upstream`): counts and TTFT of successful requests, from events.
BY_REPLICA = f"""
SELECT doc->>'upstream' AS replica,
       count(*) AS requests,
       count(*) FILTER (WHERE status = 'ok') AS ok,
       count(*) FILTER (WHERE status <> 'ok') AS errors,
       quantile_cont(ttft_ms, 0.5) FILTER (WHERE status = 'ok') AS ttft_ms_p50,
       quantile_cont(ttft_ms, 0.95) FILTER (WHERE status = 'ok') AS ttft_ms_p95,
       sum(cached_tokens) FILTER (WHERE status = 'ok') AS cached_tokens,
       sum(prompt_tokens) FILTER (WHERE status = 'ok') AS prompt_tokens
FROM events WHERE run_id = $run_id {IN_WINDOW}
GROUP BY ALL ORDER BY replica NULLS LAST
"""
ERRORS_BY_REPLICA = f"""
SELECT doc->>'upstream' AS replica, COALESCE(error, status) AS class, count(*) AS n
FROM events WHERE run_id = $run_id AND status <> 'ok' {IN_WINDOW}
GROUP BY ALL ORDER BY replica, n DESC
"""
REASONS_BY_REPLICA = f"""
SELECT doc->>'upstream' AS replica, doc->>'route_reason' AS reason, count(*) AS n
FROM events WHERE run_id = $run_id AND doc->>'route_reason' IS NOT NULL {IN_WINDOW}
GROUP BY ALL ORDER BY replica, n DESC
"""
# Per scraped server (a replica's URL is its `target`): counter growth, bucket growth, peaks.
COUNTERS_BY_TARGET = counter_deltas("list_contains($names, name)", "target, name", IN_WINDOW)
BUCKETS_BY_TARGET = counter_deltas(
    "list_contains($names, name)", "target, name, CAST(labels AS JSON)->>'le' AS le", IN_WINDOW
)
GAUGE_PEAKS_BY_TARGET = f"""
SELECT target, name, max(value) AS peak
FROM metric_samples
WHERE run_id = $run_id AND list_contains($names, name) {IN_WINDOW}
GROUP BY ALL
"""

# -- a server of several data-parallel engines: its `/metrics` series by their `engine` label --
# (reports/engines.py). vLLM labels every series with its engine, one engine or several.
ENGINE_LABEL = "CAST(labels AS JSON)->>'engine'"
ENGINES_SCRAPED = f"""
SELECT DISTINCT target, {ENGINE_LABEL} AS engine
FROM metric_samples
WHERE {SAMPLES_IN_SLICE} AND name = 'vllm:num_requests_running' AND {ENGINE_LABEL} IS NOT NULL
"""
COUNTERS_BY_ENGINE = counter_deltas(
    "list_contains($names, name)", f"target, {ENGINE_LABEL} AS engine, name", IN_WINDOW
)
GAUGES_BY_ENGINE = f"""
SELECT target, {ENGINE_LABEL} AS engine, name, max(value) AS peak, avg(value) AS mean
FROM metric_samples
WHERE {SAMPLES_IN_SLICE} AND list_contains($names, name)
GROUP BY ALL
"""
