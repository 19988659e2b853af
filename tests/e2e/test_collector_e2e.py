"""The collector next to a real vLLM: request logs (text format on the session server, JSON
format on the session's predictable-model server), OTLP traces from vLLM's
`--otlp-traces-endpoint`, /metrics, and a real bench run; the store ends with exactly one event
per request, joined across sources."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import duckdb
import pytest

from servescope.store import Store, reads
from servescope.store.settings import free_port
from tests.helpers.cli import ROOT, SERVESCOPE, servescope
from tests.helpers.vllm import RunningServer, wait_port

pytestmark = pytest.mark.vllm

N = 8
WORKLOAD = f"""workloads:
  - {{name: tiny-e2e, input_tokens: 32, output_tokens: 8, concurrency: [2]}}
requests_per_level: {N}
"""
RECEIVED = re.compile(r"Received request (\S+?): ")


def _events(store: Path, run_id: str) -> list[dict]:
    """Read while the collector writes: the store's reader waits out a flush, never fails."""
    with Store(store).read() as con:
        sql = "SELECT * FROM events WHERE run_id = ? ORDER BY request_id"
        return reads.rows(con.execute(sql, [run_id]))


def _collect_during_bench(
    url: str, log: Path, otlp_port: int, folder: Path, run_id: str
) -> tuple[list[dict], str, Path]:
    """Collector on (log, traces, /metrics, bench's events files) while a bench run of N requests
    goes; returns the run's events once all carry their trace, the collector's /metrics text,
    and the store."""
    store = folder / "store.duckdb"
    config = folder / "workload.yaml"
    config.write_text(WORKLOAD)
    metrics_port = free_port()
    out = folder / "collector.out"
    collector = subprocess.Popen(
        [
            *SERVESCOPE,
            "collect",
            "--vllm-log",
            str(log),
            "--otlp-port",
            str(otlp_port),
            "--metrics-url",
            f"{url}/metrics",
            "--scrape-interval",
            "1",
            "--metrics-port",
            str(metrics_port),
            "--events",
            str(folder / "servescope-data" / "events" / "*.events.jsonl"),
            "--store",
            str(store),
        ],  # fmt: skip
        cwd=ROOT,
        stdout=out.open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        wait_port(otlp_port, collector, out)
        bench = servescope(
            "bench", "run", "--config", str(config), "--target", url, "--run-id", run_id,
            "--store", str(store), "--json", cwd=folder,
            env={"SERVESCOPE_DATA_DIR": str(folder / "servescope-data")},
        )  # fmt: skip
        assert bench.returncode == 0, bench.stderr
        # reads while the collector writes: never a lock error, and they see each flush
        deadline = time.monotonic() + 90
        events: list[dict] = []
        while time.monotonic() < deadline:
            events = _events(store, run_id)
            if len(events) == N and all(e["queue_ms"] is not None for e in events):
                break
            time.sleep(0.25)  # poll: done the moment the last piece is in
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics") as resp:
            own_metrics = resp.read().decode()
    finally:
        collector.send_signal(signal.SIGTERM)
        code = collector.wait(timeout=60)
    assert code == 0, f"collector exited {code} on SIGTERM:\n{out.read_text()}"
    return events, own_metrics, store


def _assert_joined(events: list[dict], run_id: str) -> None:
    assert len(events) == N, [e["request_id"] for e in events]
    assert [e["request_id"] for e in events] == [f"{run_id}-{i:06d}" for i in range(1, N + 1)]
    for event in events:
        doc = json.loads(event["doc"])
        assert event["ttft_ms"] is not None and event["e2e_ms"] is not None  # the client's
        for key in ("queue_ms", "prefill_ms", "decode_ms"):  # the trace's
            assert event[key] is not None and event[key] >= 0, (key, doc)
        assert doc["server_e2e_ms"] <= doc["e2e_ms"] + 1.0  # the server saw less than the client
        assert doc["vllm_request_id"] == f"cmpl-{event['request_id']}-0"  # log and trace
        assert doc.get("engine_request_id", "").startswith(f"cmpl-{event['request_id']}-0-")
        assert event["completion_tokens"] == 8 and event["status"] == "ok"


def _assert_own_metrics(text: str) -> None:
    for name in (
        "servescope_collector_lines_total",
        "servescope_collector_events_written_total",
        "servescope_collector_lag_seconds",
        "servescope_collector_last_flush_timestamp_seconds",
    ):
        assert name in text, name
    written = re.search(r"^servescope_collector_events_written_total (\S+)$", text, re.M)
    assert written and float(written[1]) >= N


def _assert_scraped(store: Path, url: str) -> None:
    con = duckdb.connect(str(store), read_only=True)
    try:
        up = con.execute(
            "SELECT max(value), count(*) FILTER (WHERE value NOT IN (0, 1)) FROM metric_samples "
            "WHERE name = 'up' AND target = ?",
            [f"{url}/metrics"],
        ).fetchone()
        ttft = con.execute(
            "SELECT count(*) FROM metric_samples WHERE name LIKE 'vllm:time_to_first_token%'"
        ).fetchone()
    finally:
        con.close()
    # a scrape slower than the collector's timeout (a busy machine) is an honest up = 0: every
    # scrape recorded its outcome (0 or 1), and the server's page was had (up = 1, its series)
    assert up is not None and up[0] == 1.0 and up[1] == 0, up
    assert ttft is not None and ttft[0] > 0


def _client_ids_in_log(log: Path) -> set[str]:
    """The client ids the log says vLLM received, read independently of the collector."""
    ids = set()
    for vllm_id in RECEIVED.findall(log.read_text(errors="replace")):
        if vllm_id.startswith(("tokenize-", "detokenize-")):
            continue  # not a generation request
        if vllm_id.startswith("chatcmpl-"):
            ids.add(vllm_id[len("chatcmpl-") :])
        elif vllm_id.startswith("cmpl-"):
            ids.add(vllm_id[len("cmpl-") :].rsplit("-", 1)[0])
        else:
            ids.add(vllm_id)
    return ids


def test_text_log_traces_and_bench_make_one_event_per_request(
    vllm_server: RunningServer, tmp_path: Path
) -> None:
    run_id = "run-20261122-colltext"
    events, own, store = _collect_during_bench(
        vllm_server.url, vllm_server.log, vllm_server.otlp_port, tmp_path, run_id
    )
    _assert_joined(events, run_id)
    _assert_own_metrics(own)
    _assert_scraped(store, vllm_server.url)

    # batch import of the same log alone: one event per request vLLM received, client ids
    once = tmp_path / "once.duckdb"
    result = servescope(
        "collect", "--once", "--vllm-log", str(vllm_server.log), "--store", str(once), "--json"
    )
    assert result.returncode == 0, result.stderr
    con = duckdb.connect(str(once), read_only=True)
    ids = {r[0] for r in con.execute("SELECT request_id FROM events").fetchall()}
    mine = con.execute("SELECT count(*) FROM events WHERE run_id = ?", [run_id]).fetchone()
    con.close()
    assert ids == _client_ids_in_log(vllm_server.log)
    assert mine == (N,)


def test_json_log_traces_and_bench_make_one_event_per_request(
    predictable_vllm_server: RunningServer, tmp_path: Path
) -> None:
    server = predictable_vllm_server
    assert server.log.read_text().lstrip().startswith("{") or any(
        line.startswith("{") for line in server.log.read_text().splitlines()
    ), "the server did not log in JSON"
    run_id = "run-20261122-colljson"
    events, own, store = _collect_during_bench(
        server.url, server.log, server.otlp_port, tmp_path, run_id
    )
    _assert_joined(events, run_id)
    _assert_own_metrics(own)

    once = tmp_path / "once.duckdb"
    result = servescope(
        "collect", "--once", "--vllm-log", str(server.log), "--store", str(once), "--json"
    )
    assert result.returncode == 0, result.stderr
    con = duckdb.connect(str(once), read_only=True)
    ids = sorted(r[0] for r in con.execute(
        "SELECT request_id FROM events WHERE run_id = ?", [run_id]).fetchall())  # fmt: skip
    levers = con.execute("SELECT state FROM checkpoints WHERE file_key = ''").fetchone()
    con.close()
    assert ids == [f"{run_id}-{i:06d}" for i in range(1, N + 1)]  # once each, none missing
    session = json.loads(levers[0])["session"] if levers else {}
    assert session["args"]["served_model_name"] == [server.served_name]
    assert session["model"] == server.served_name


def test_n_samples_and_prompt_lists_are_stored_with_the_apis_usage(
    vllm_server: RunningServer, tmp_path: Path
) -> None:
    """OpenAI SDK calls that vLLM serves in parts: a chat call with n=2 (child requests
    `0_chatcmpl-R`, `1_chatcmpl-R`, whose trace spans both say `chatcmpl-R`) and a completions
    call with two prompts and n=2 (four children, `cmpl-R-0`/`cmpl-R-1`). Each is one event whose
    tokens are what the API's usage said: before, the event kept one child's completion_tokens
    (8 where usage said 16)."""
    import openai  # the client users have; only this test needs it

    store = tmp_path / "store.duckdb"
    out = tmp_path / "collector.out"
    collector = subprocess.Popen(
        [*SERVESCOPE, "collect", "--vllm-log", str(vllm_server.log), "--otlp-port",
         str(vllm_server.otlp_port), "--metrics-port", str(free_port()), "--store", str(store)],
        cwd=ROOT, stdout=out.open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    run_id = "run-20261125-nsample"
    try:
        wait_port(vllm_server.otlp_port, collector, out)
        client = openai.OpenAI(base_url=f"{vllm_server.url}/v1", api_key="unused")
        chat = client.chat.completions.create(
            model=vllm_server.served_name,
            messages=[{"role": "user", "content": "two samples of this, please"}],
            n=2,
            max_tokens=8,
            extra_headers={"X-Request-Id": f"{run_id}-000001"},
        )
        listed = client.completions.create(
            model=vllm_server.served_name,
            prompt=["a first prompt", "a second prompt, somewhat longer than the first"],
            n=2,
            max_tokens=6,
            extra_headers={"X-Request-Id": f"{run_id}-000002"},
        )
        usage = {
            f"{run_id}-000001": (chat.usage.prompt_tokens, chat.usage.completion_tokens, 2),
            f"{run_id}-000002": (listed.usage.prompt_tokens, listed.usage.completion_tokens, 4),
        }
        deadline = time.monotonic() + 90  # vLLM exports its spans in batches, every 5 s
        events: list[dict] = []
        while time.monotonic() < deadline:
            events = _events(store, run_id)
            if len(events) == 2 and all(
                len(json.loads(e["doc"]).get("parts", {})) == usage[e["request_id"]][2]
                for e in events
            ):
                break
            time.sleep(0.25)  # poll: done the moment the last piece is in
    finally:
        collector.send_signal(signal.SIGTERM)
        code = collector.wait(timeout=60)
    assert code == 0, f"collector exited {code} on SIGTERM:\n{out.read_text()}"
    assert [e["request_id"] for e in events] == sorted(usage), events
    for event in events:
        doc = json.loads(event["doc"])
        prompt, completion, parts = usage[event["request_id"]]
        stored = (event["prompt_tokens"], event["completion_tokens"])
        assert stored == (prompt, completion), (event["request_id"], doc)
        assert len(doc["parts"]) == parts, doc
        assert sum(p["completion_tokens"] for p in doc["parts"].values()) == completion
        assert doc["n"] == 2 and doc["log_ts"] is not None  # the log's pieces joined too
        assert doc["server_ttft_ms"] == min(p["server_ttft_ms"] for p in doc["parts"].values())
        assert doc["server_e2e_ms"] == max(p["server_e2e_ms"] for p in doc["parts"].values())
        # vLLM's TPOT is a sample's, not the longest decode over every sample's tokens
        tpots = [p["decode_ms"] / (p["completion_tokens"] - 1) for p in doc["parts"].values()]
        assert event["server_tpot_ms"] == pytest.approx(sum(tpots) / len(tpots))
