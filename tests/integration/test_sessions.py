"""Server sessions from logs written the way vLLM 0.32 writes them (lines copied from a real
server started by hand): each server lifetime is a run named from its model, port and start;
several servers tailed by one collector (one per MIG slice) are separate sessions; requests
without a client id and refused requests land in their session; a restart is one flip per lever
between two runs; the reports of such runs say where each indicator comes from, and can be cut
to a window of a long-lived session."""

from __future__ import annotations

import http.server
import json
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

from tests.helpers.cli import servescope
from tests.helpers.stand_ins import RestartableVllmMetrics
from tests.helpers.stored import rows


def _server_log(port: int, minute: int, caching: bool, requests: list[str]) -> list[str]:
    """One server lifetime: banner, args, listening line, requests, refusals, shutdown."""
    at = f"11-24 20:{minute:02d}"
    head = f"(APIServer pid={port}) INFO {at}"
    lines = [
        f"{head}:01 [api_utils.py:347]   █▄█▀ █     █     █     █  version 0.32.0",
        f"{head}:01 [api_utils.py:286] non-default args: {{'port': {port}, 'model': "
        f"'/models/tiny', 'served_model_name': ['tiny'], 'enable_prefix_caching': {caching}, "
        "'api_key': 'sk-secret'}",
        f"{head}:30 [entry.py:140] Starting vLLM server on http://0.0.0.0:{port}",
    ]
    for i, rid in enumerate(requests):
        lines += [
            f"{head}:{40 + i:02d} [request_logger.py:65] Received request cmpl-{rid}-0: params: "
            "SamplingParams(n=1, max_tokens=8), lora_request: None.",
            f"{head}:{40 + i:02d} [async_llm.py:578] Added request cmpl-{rid}-0-0a1b2c3d.",
            f'INFO:     127.0.0.1:5{i:04d} - "POST /v1/completions HTTP/1.1" 200 OK',
        ]
    lines += [
        'INFO:     127.0.0.1:41000 - "POST /v1/completions HTTP/1.1" 400 Bad Request',
        'INFO:     127.0.0.1:41001 - "GET /metrics HTTP/1.1" 404 Not Found',  # not a request
        f"{head}:59 [launcher.py:254] [shutdown] API server: shutdown triggered",
    ]
    return lines


def _collect(*args: str, env: dict[str, str] | None = None) -> None:
    """`collect --once` as the sidecar of host `gpu-1`: its sessions' ids name it."""
    servescope("collect", "--once", "--instance", "gpu-1", *args, env=env, check=True)


def test_a_log_across_a_restart_and_two_slices_give_their_sessions(tmp_path: Path) -> None:
    slice_a, slice_b = tmp_path / "mig-a.log", tmp_path / "mig-b.log"
    slice_a.write_text("\n".join(
        _server_log(8001, 10, False, ["1b2c3d4e5f6a7b8c", "run-x-000001"])
        + _server_log(8001, 20, True, ["2b2c3d4e5f6a7b8c"])
    ) + "\n")  # fmt: skip
    slice_b.write_text("\n".join(_server_log(8002, 10, True, ["3b2c3d4e5f6a7b8c"])) + "\n")
    store = tmp_path / "s.duckdb"
    _collect("--vllm-log", str(slice_a), "--vllm-log", str(slice_b), "--store", str(store))
    runs = rows(store, "SELECT run_id, target, model, vllm_version, status, levers FROM runs "
                        "ORDER BY run_id")  # fmt: skip
    first, second, other = (
        "vllm-tiny-gpu-1-8001-20261124T201001Z",
        "vllm-tiny-gpu-1-8001-20261124T202001Z",
        "vllm-tiny-gpu-1-8002-20261124T201001Z",
    )
    assert [r[:5] for r in runs] == [
        (first, "http://127.0.0.1:8001", "tiny", "0.32.0", "ended"),
        (second, "http://127.0.0.1:8001", "tiny", "0.32.0", "ended"),
        (other, "http://127.0.0.1:8002", "tiny", "0.32.0", "ended"),
    ]
    levers = json.loads(runs[0][5])
    assert levers["enable_prefix_caching"] is False and "api_key" not in levers
    assert "port" not in levers  # identity, not configuration
    events = rows(store, "SELECT run_id, request_id, status, http_status, vllm_session, model "
                          "FROM events ORDER BY run_id, request_id")  # fmt: skip
    assert [(e[0], e[1]) for e in events if e[2] == "ok"] == [
        ("run-x", "run-x-000001"),  # a client's id keeps the client's run…
        (first, "1b2c3d4e5f6a7b8c"),
        (second, "2b2c3d4e5f6a7b8c"),
        (other, "3b2c3d4e5f6a7b8c"),
    ]
    assert events[-1][4] == other  # …and every request names the session that served it
    assert {e[4] for e in events if e[0] == "run-x"} == {first}
    refused = [(e[0], e[3]) for e in events if e[2] == "error"]
    assert sorted(refused) == [(first, 400), (second, 400), (other, 400)]
    assert all(e[5] == "tiny" for e in events)
    flips = rows(store, "SELECT lever, before, after, before_run_id, run_id FROM lever_flips")
    assert flips == [("enable_prefix_caching", "false", "true", first, second)]

    # reading again changes nothing; the reports of the sessions
    _collect("--vllm-log", str(slice_a), "--vllm-log", str(slice_b), "--store", str(store))
    assert len(rows(store, "SELECT * FROM events")) == len(events)
    listing = servescope("report", "flips", "--json", "--store", str(store), check=True)
    (flip,) = json.loads(listing.stdout)
    assert flip["report"] == f"servescope report build {second} --vs {first}"
    out = tmp_path / "reports"
    built = servescope("report", "build", second, "--vs", "previous", "--format", "json",
                       "--out", str(out), "--store", str(store), "--json", check=True)  # fmt: skip
    report = json.loads(Path(json.loads(built.stdout)["paths"][0]).read_text())
    assert report["base_run_id"] == first
    # the flip is the restart itself: splitting the new session there compares nothing
    split = servescope("report", "build", second, "--split-at-flip", "--store", str(store))
    said = " ".join(split.stderr.split())  # the console wraps at its width
    assert split.returncode == 2 and f"report build {second} --vs previous" in said
    assert report["before"]["overall"]["requests"] == 3  # its own 2 + the client's 1 it served
    assert report["before"]["overall"]["errors_by_class"] == {"http_4xx": 1}
    assert report["after"]["overall"]["error_rate"] == 0.5


def test_windows_of_a_session(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    ids = [f"{i:016x}" for i in range(1, 11)]
    log.write_text("\n".join(_server_log(8001, 10, True, ids)) + "\n")
    store = tmp_path / "s.duckdb"
    _collect("--vllm-log", str(log), "--store", str(store))
    run = "vllm-tiny-gpu-1-8001-20261124T201001Z"

    def requests(*window: str) -> int:
        built = servescope(
            "report", "build", run, *window, "--format", "json", "--out", str(tmp_path / "r"),
            "--store", str(store), "--json", check=True,
        )  # fmt: skip
        path = Path(json.loads(built.stdout)["paths"][0])
        return json.loads(path.read_text())["overall"]["requests"]

    assert requests() == 11  # 10 requests, 1 refused (at the last line's time, 20:10:49)
    assert requests("--since", "2026-11-24T20:10:45Z") == 6
    assert requests("--until", "start+43s") == 4  # started 20:10:01: requests 20:10:40 … :43
    assert requests("--since", "end-10s", "--until", "end") == 2  # ended 20:10:59: :49 and refused
    same = servescope("report", "build", run, "--until", "start+44s", "--vs", run,
                      "--vs-since", "start+44s", "--format", "json", "--out", str(tmp_path / "r"),
                      "--store", str(store), "--json", check=True)  # fmt: skip
    assert "@" in json.loads(same.stdout)["report_id"]
    bad = servescope("report", "build", run, "--since", "yesterday", "--store", str(store))
    assert bad.returncode == 2 and "not a time" in bad.stderr and "Traceback" not in bad.stderr
    none = servescope("report", "build", run, "--vs", "previous", "--store", str(store))
    assert none.returncode == 2 and "follows no other run" in none.stderr


def test_indicators_come_from_the_server_where_the_client_timed_nothing(tmp_path: Path) -> None:
    from servescope.store import Store

    store = Store(tmp_path / "s.duckdb")
    ttft = [100.0 + 10 * i for i in range(20)]

    def docs(run: str, client: bool) -> list[dict]:
        out = []
        for i, value in enumerate(ttft):
            doc = {"request_id": f"{run}-{i + 1:06d}", "run_id": run, "status": "ok",
                   "ts": f"2026-11-24T20:10:{i:02d}Z", "server_ttft_ms": value,
                   "server_e2e_ms": value + 300.0, "decode_ms": 300.0, "completion_tokens": 31,
                   "queue_ms": 1.0, "prefill_ms": value - 1.0}  # fmt: skip
            if client:
                doc.update(ttft_ms=value + 2.0, e2e_ms=value + 305.0, tpot_ms=10.0)
            out.append(doc)
        return out

    store.add_events(docs("run-sdk", client=False) + docs("run-bench", client=True))
    out = tmp_path / "r"

    def report(*args: str) -> dict:
        built = servescope("report", "build", *args, "--format", "json", "--out", str(out),
                           "--store", str(store.path), "--json", check=True)  # fmt: skip
        return json.loads(Path(json.loads(built.stdout)["paths"][0]).read_text())

    sdk = report("run-sdk")["overall"]
    assert sdk["sources"]["ttft_ms"] == "server" and sdk["ttft_ms"]["p50"] == 195.0
    assert sdk["tpot_ms"]["p50"] == 10.0  # vLLM's TPOT: decode 300 ms over 30 tokens after the 1st
    assert "server_ttft_ms" not in sdk  # shown once, as the indicator itself
    bench = report("run-bench")["overall"]
    assert bench["sources"]["ttft_ms"] == "client" and bench["ttft_ms"]["p50"] == 197.0
    assert bench["server_ttft_ms"]["p50"] == 195.0  # vLLM's own beside the client's
    diff = report("run-bench", "--vs", "run-sdk")
    row = next(r for r in diff["diff"] if r["metric"] == "ttft_ms.p50")
    assert row["source"] == "server" and row["before"] == row["after"] == 195.0  # never mixed


# `vllm:cache_config_info` as vLLM 0.32 serves it (labels copied from a real server's /metrics;
# the consequences — block counts, KV size, mamba settings — left out).
REAL_CACHE_CONFIG = {
    "block_size": "128", "cache_dtype": "auto", "enable_prefix_caching": "False",
    "gpu_memory_utilization": "0.92", "kv_offloading_backend": "native",
    "kv_offloading_size": "None", "num_gpu_blocks_override": "None",
    "prefix_caching_hash_algo": "sha256",
}  # fmt: skip


class _RestartingVllmMetrics(RestartableVllmMetrics):
    """The `/metrics` of a vLLM restarted by hand (the log is the test's)."""

    CONFIG = dict(REAL_CACHE_CONFIG)
    STARTED = datetime(2026, 11, 24, 20, 9, 58, tzinfo=UTC).timestamp()


def test_a_restart_not_scraped_yet_flips_only_the_lever_that_changed(tmp_path: Path) -> None:
    """Between a restart's `non-default args` line and the first scrape of the new process, the
    new session knows none of the cache levers only `/metrics` shows (block size, KV dtype…):
    unknown is not "unset", so the only flip is the flag the operator changed — in the store and
    in the collector's `servescope_lever_flip_info` that dashboards annotate."""
    from servescope.collector import Collector
    from servescope.collector.sources.logs import VllmLog
    from servescope.collector.sources.metrics import MetricsTarget
    from servescope.store import Store

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RestartingVllmMetrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    log = tmp_path / "vllm.log"
    first, second = (
        _server_log(port, 10, False, ["1b2c3d4e5f6a7b8c"]),
        _server_log(port, 20, True, ["2b2c3d4e5f6a7b8c"]),
    )
    log.write_text("\n".join(first[:-1]) + "\n")  # the first server, still running
    store = Store(tmp_path / "s.duckdb")
    collector = Collector(
        store, [VllmLog(str(log)), MetricsTarget(f"http://127.0.0.1:{port}/metrics")]
    )
    flips_sql = "SELECT lever, before, after FROM lever_flips ORDER BY lever"
    try:
        collector.poll()
        collector.scrape_all()
        collector.flush()
        with log.open("a") as out:  # the operator restarts it with prefix caching on
            out.write("\n".join([first[-1], *second]) + "\n")
        collector.poll()
        collector.flush()  # the new process is not scraped yet
        assert rows(store.path, flips_sql) == [("enable_prefix_caching", "false", "true")]
        _RestartingVllmMetrics.CONFIG = {**REAL_CACHE_CONFIG, "enable_prefix_caching": "True"}
        _RestartingVllmMetrics.STARTED += 600
        collector.scrape_all()
        collector.flush()
    finally:
        server.shutdown()
        collector.close()
    assert rows(store.path, flips_sql) == [("enable_prefix_caching", "false", "true")]
    annotated = {
        (s.labels["lever"], s.labels["before"], s.labels["after"])
        for metric in collector.metrics.registry.collect()
        if metric.name == "servescope_lever_flip_info"
        for s in metric.samples
    }
    assert annotated == {("enable_prefix_caching", "false", "true")}


def test_a_refusal_read_live_is_dated_when_it_was_written_not_at_the_last_dated_line(
    tmp_path: Path,
) -> None:
    """uvicorn's access lines carry no time. A collector that has read its log to the end and
    finds a 400 on the next poll knows it was written since: the refusal is dated then, not
    at the server's last dated line (a start-up a minute earlier, on an idle server hours),
    which shifted it out of `--since` windows and stretched the run's throughput span."""
    from servescope.collector import Collector
    from servescope.collector.sources.logs import VllmLog
    from servescope.store import Store

    started = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=30)
    head = f"(APIServer pid=1) INFO {started:%m-%d %H:%M:%S}"
    log = tmp_path / "vllm.log"
    log.write_text(
        f"{head} [api_utils.py:347]   █▄█▀ █     █     █     █  version 0.32.0\n"
        f"{head} [api_utils.py:286] non-default args: {{'port': 8001, 'model': '/m/tiny', "
        "'served_model_name': ['tiny']}\n"
        f"{head} [entry.py:140] Starting vLLM server on http://0.0.0.0:8001\n"
    )
    store = Store(tmp_path / "s.duckdb")
    collector = Collector(store, [VllmLog(str(log))])
    try:
        collector.poll()
        collector.flush()  # read to the end: the server is up and idle
        before = datetime.now(UTC).replace(tzinfo=None)
        with log.open("a") as out:
            out.write(
                'INFO:     127.0.0.1:41000 - "POST /v1/completions HTTP/1.1" 400 Bad Request\n'
            )
        collector.poll()
        collector.flush()
        after = datetime.now(UTC).replace(tzinfo=None)
    finally:
        collector.close()
    ((ts, status),) = rows(store.path, "SELECT ts, status FROM events")
    # between the write and the flush that read it, however long those took (a second either
    # side for the stored precision)
    second = timedelta(seconds=1)
    assert status == "error" and before - second <= ts <= after + second, (before, ts, after)
    once = tmp_path / "once.duckdb"
    _collect("--vllm-log", str(log), "--store", str(once))
    assert rows(once, "SELECT count(*), min(status) FROM events") == [(1, "error")]


# Lines of a real vLLM 0.32 serving, without X-Request-Id, a chat call and a completion with
# n=2 (parallel sampling: the engine logs one child `<i>_<id>` per sample) and a Responses API
# call (`resp_<hex>_<i>`, X-Request-Id ignored) — as the OpenAI SDK sends them.
_AT = "(APIServer pid=13762) INFO 11-25 00:23:14"
_PARAMS = "params: SamplingParams(n={n}, presence_penalty=0.0, frequency_penalty=0.0, max_tokens=8)"
SAMPLED_AND_RESPONSES_LOG = [
    "(APIServer pid=13762) INFO 11-25 00:22:49 [api_utils.py:347]  ▄▄ ▄█ █     █     █ ▀▄▀ █  "
    "version 0.32.0",
    "(APIServer pid=13762) INFO 11-25 00:22:49 [api_utils.py:286] non-default args: {'port': "
    "18123, 'model': '/tmp/qa/tiny', 'dtype': 'float32', 'max_model_len': 4096, "
    "'served_model_name': ['tiny'], 'enable_prefix_caching': True, 'enable_log_requests': True}",
    "(APIServer pid=13762) INFO 11-25 00:23:13 [entry.py:140] Starting vLLM server on "
    "http://0.0.0.0:18123",
    f"{_AT} [request_logger.py:65] Received request chatcmpl-b22e175ad4d0dc57: "
    + _PARAMS.format(n=2),
    f"{_AT} [async_llm.py:552] Added request 0_chatcmpl-b22e175ad4d0dc57-aaa9004b.",
    f"{_AT} [async_llm.py:552] Added request 1_chatcmpl-b22e175ad4d0dc57-aaa9004b.",
    'INFO:     127.0.0.1:52660 - "POST /v1/chat/completions HTTP/1.1" 200 OK',
    f"{_AT} [request_logger.py:65] Received request cmpl-aba708d7335bfac1-0: "
    + _PARAMS.format(n=2),
    f"{_AT} [async_llm.py:552] Added request 0_cmpl-aba708d7335bfac1-0-b0a7b53f.",
    f"{_AT} [async_llm.py:552] Added request 1_cmpl-aba708d7335bfac1-0-b0a7b53f.",
    'INFO:     127.0.0.1:52660 - "POST /v1/completions HTTP/1.1" 200 OK',
    f"{_AT} [request_logger.py:65] Received request resp_8d338686ca4c395a_0: "
    + _PARAMS.format(n=1),
    f"{_AT} [async_llm.py:578] Added request resp_8d338686ca4c395a_0-99ea019e.",
    'INFO:     127.0.0.1:52660 - "POST /v1/responses HTTP/1.1" 200 OK',
]


def test_parallel_samples_and_responses_calls_are_one_request_each_in_their_session(
    tmp_path: Path,
) -> None:
    """One HTTP request is one event in the session's run, whatever ids the engine gives its
    parts: before, each sample of an n=2 call was an extra request in a run of its own
    (`0_chatcmpl-…`), and each Responses API call was a run of its own (`resp_…_0`)."""
    log = tmp_path / "vllm.log"
    log.write_text("\n".join(SAMPLED_AND_RESPONSES_LOG) + "\n")
    store = tmp_path / "s.duckdb"
    _collect("--vllm-log", str(log), "--store", str(store))
    session = "vllm-tiny-gpu-1-18123-20261125T002249Z"
    assert rows(store, "SELECT run_id, request_id FROM events ORDER BY request_id") == [
        (session, "8d338686ca4c395a"),
        (session, "aba708d7335bfac1"),
        (session, "b22e175ad4d0dc57"),
    ]


def test_a_server_logging_local_time_is_read_in_utc(tmp_path: Path) -> None:
    """vLLM's log lines carry the host's local time (Python logging's default converter), no
    zone. The collector, its sidecar on the same host, reads them in that local time: on a
    host in Berlin a server started at 21:10:01 local started at 20:10:01 UTC, the run is
    named so and its requests' times line up with vLLM's traces and `/metrics` (UTC)."""
    log = tmp_path / "vllm.log"
    lines = _server_log(8001, 10, True, ["1b2c3d4e5f6a7b8c"])
    log.write_text("\n".join(line.replace("11-24 20:", "11-24 21:") for line in lines) + "\n")
    store = tmp_path / "s.duckdb"
    _collect("--vllm-log", str(log), "--store", str(store), env={"TZ": "Europe/Berlin"})
    assert rows(store, "SELECT run_id, started_at, ended_at FROM runs") == [
        (
            "vllm-tiny-gpu-1-8001-20261124T201001Z",
            datetime(2026, 11, 24, 20, 10, 1),
            datetime(2026, 11, 24, 20, 10, 59),
        )
    ]
    assert rows(store, "SELECT min(ts) FROM events WHERE status = 'ok'") == [
        (datetime(2026, 11, 24, 20, 10, 40),)
    ]
