"""Every dashboard panel query returns data from a real Prometheus (Debian `prometheus`, started
here on loopback with its own TSDB) that scraped, every second, the session's real vLLM, a real
servescope gateway and a real servescope collector while a short bench ran: prompts sharing a
prefix straight at vLLM, streaming requests of two teams through the gateway (some rejected),
a half-written line for the collector, and prompts that quote the predictable model's passage
at a second real vLLM with n-gram speculative decoding (drafts proposed and accepted). The GPU
row reads dcgm-exporter's series: CI has no GPU, so Prometheus scrapes a dcgm-exporter page
recorded on a GPU server (tests/fixtures/gpu/dcgm-exporter.txt). A panel whose query returns
nothing fails by its title.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from servescope.dashboards import DASHBOARDS, RULES_DIR, dashboard_json
from servescope.dashboards.lint import PanelQuery, annotation_queries, queries, substitute
from servescope.store.settings import free_port
from tests.helpers.cli import ROOT, SERVESCOPE, bench_args, servescope
from tests.helpers.vllm import RunningServer

pytestmark = pytest.mark.vllm

SCRAPE = "1s"
SCRAPE_S = 1.0
RATE_INTERVAL = "1m"
WORKLOAD = """
workloads:
  - name: shared-prefix          # 256 shared tokens = two 128-token KV blocks: prefix-cache hits
    prefix_tokens: 256
    input_tokens: 24
    output_tokens: 12
    concurrency: [1, 3]
    requests_per_level: 5
  - {name: plain, input_tokens: 64, output_tokens: 24, concurrency: [2], requests_per_level: 4}
"""
# At the speculative-decoding vLLM (predictable model): outputs that repeat the prompt.
SPEC_WORKLOAD = """
workloads:
  - {name: repeat, text: passage, input_tokens: 128, output_tokens: 32, concurrency: [1],
     requests_per_level: 6}
"""
GATEWAY_KEYS = {"alpha": "sk-dash-alpha-7f3c", "beta": "sk-dash-beta-91d2"}

# A metric a panel reads that its producer does not export yet. The test requires such a metric
# to be absent from every scraped target (so the day it appears, this entry must go) and reports
# the panels it leaves unproven.
AWAITED: dict[str, str] = {}


@dataclass
class Prometheus:
    url: str

    def get(self, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=30) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return body["data"]

    def has_series(self, metric: str) -> bool:
        return bool(self.get("/api/v1/series", **{"match[]": f'{{__name__="{metric}"}}'}))


def _start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(args, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _wait_http(url: str, process: subprocess.Popen[bytes], log: Path, what: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"{what} exited {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    pytest.fail(f"{what} not ready at {url}:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def events_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the gateway writes its events and the collector tails them."""
    return tmp_path_factory.mktemp("events")


@pytest.fixture(scope="module")
def gateway(
    vllm_server: RunningServer, events_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A real `servescope gateway` in front of the session's vLLM: team alpha with room and a
    token budget it never exhausts, team beta with a 16-token prompt cap (its longer prompts are
    rejected: prompt_too_long)."""
    folder = tmp_path_factory.mktemp("gateway")
    port = free_port()
    config = {
        "listen": {"host": "127.0.0.1", "port": port},
        "events_dir": str(events_dir),
        "upstreams": {"main": {"url": vllm_server.url, "model": "tiny", "max_concurrent": 8}},
        "models": {"tiny": {"upstream": "main"}},
        "teams": {
            "alpha": {
                "keys": [GATEWAY_KEYS["alpha"]],
                "max_concurrent": 2,
                "max_queue": 8,
                "token_budget": {"tokens": 1_000_000, "window_s": 3600},
            },
            "beta": {"keys": [GATEWAY_KEYS["beta"]], "max_prompt_tokens": 16},
        },
    }
    path = folder / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    log = folder / "gateway.log"
    process = _start([*SERVESCOPE, "gateway", "--config", str(path)], log)
    url = f"http://127.0.0.1:{port}"
    _wait_http(f"{url}/health", process, log, "servescope gateway")
    yield url
    _stop(process)


@dataclass
class Collector:
    url: str
    restarts_log: Path  # a vLLM log the test extends with a restart (a lever flip)


NON_DEFAULT_ARGS = re.compile(r"^.* non-default args: \{.*\}$", re.MULTILINE)


@pytest.fixture(scope="module")
def collector(
    vllm_server: RunningServer, events_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Collector]:
    """The collector sidecar: scrapes vLLM, tails vLLM's log and the gateway's events, serves its
    own /metrics. It also tails a log holding the session vLLM's real start-up line; the test
    appends that line again with one lever changed, as a restart with prefix caching off would
    write it (a lever flip)."""
    folder = tmp_path_factory.mktemp("collector")
    started = NON_DEFAULT_ARGS.search(vllm_server.log.read_text(errors="replace"))
    assert started, f"no `non-default args` line in {vllm_server.log}"
    restarts = folder / "vllm-restarts.log"
    restarts.write_text(started.group(0) + "\n")
    port = free_port()
    log = folder / "collector.log"
    process = _start(
        [
            *SERVESCOPE,
            "collect",
            "--metrics-port",
            str(port),
            "--metrics-url",
            f"{vllm_server.url}/metrics",
            "--vllm-log",
            str(vllm_server.log),
            "--vllm-log",
            str(restarts),
            "--events",
            str(events_dir / "*.events.jsonl"),
            "--scrape-interval",
            "1",
            "--store",
            str(folder / "collector.duckdb"),
        ],
        log,
    )
    url = f"http://127.0.0.1:{port}"
    _wait_http(f"{url}/metrics", process, log, "servescope collect")
    yield Collector(url, restarts)
    _stop(process)


@pytest.fixture(scope="module")
def gpu_collector(
    vllm_server: RunningServer, dcgm_exporter: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A collector next to the session's vLLM alone with the recorded dcgm-exporter page: the
    one server running gets GPU 0 (`servescope_gpu_server_info`), which the per-server joules
    per token panel joins on."""
    folder = tmp_path_factory.mktemp("gpu-collector")
    port = free_port()
    log = folder / "collector.log"
    process = _start(
        [*SERVESCOPE, "collect", "--metrics-port", str(port), "--metrics-url",
         f"{vllm_server.url}/metrics", "--dcgm-url", f"{dcgm_exporter}/metrics",
         "--scrape-interval", "1", "--store", str(folder / "collector.duckdb")],
        log,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    _wait_http(f"{url}/metrics", process, log, "servescope collect (GPU)")
    yield url
    _stop(process)


@pytest.fixture(scope="module")
def prometheus(
    vllm_server: RunningServer,
    spec_vllm_server: RunningServer,
    gateway: str,
    collector: Collector,
    gpu_collector: str,
    dcgm_exporter: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Prometheus]:
    binary = shutil.which("prometheus")
    assert binary, "prometheus not found: install Debian's `prometheus` package (make system-deps)"
    folder = tmp_path_factory.mktemp("prometheus")
    targets = {
        "vllm": vllm_server.url,
        "vllm-speculative": spec_vllm_server.url,
        "servescope-gateway": gateway,
        "servescope-collector": collector.url,
        "servescope-collector-gpu": gpu_collector,
        "dcgm-exporter": dcgm_exporter,  # a page recorded on a GPU server (tests/fixtures/gpu/)
    }
    config = {
        "global": {"scrape_interval": SCRAPE, "evaluation_interval": SCRAPE},
        "rule_files": [str(p) for p in sorted(RULES_DIR.glob("*.yml"))],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": [url.removeprefix("http://")]}]}
            for job, url in targets.items()
        ],
    }
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = folder / "prometheus.log"
    process = _start(
        [
            binary,
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        log,
    )
    prom = Prometheus(f"http://127.0.0.1:{port}")
    _wait_http(f"{prom.url}/-/ready", process, log, "prometheus")
    deadline = time.monotonic() + 60
    while len(prom.get("/api/v1/query", query="up == 1")["result"]) < len(targets):
        assert time.monotonic() < deadline, prom.get("/api/v1/targets")
        time.sleep(0.5)
    yield prom
    _stop(process)


def _through_gateway(gateway: str, team: str, prompt: str) -> int | str:
    # 48 tokens: enough that a busy vLLM, which can send a short answer in one chunk, shows the
    # gateway the decode of some streams (their TPOT feeds the per-team TPOT panel)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 48, "stream": True, "ignore_eos": True}
    request = urllib.request.Request(
        f"{gateway}/v1/completions",
        data=json.dumps(body).encode(),
        headers={
            "Content-Type": "application/json",
            "Authorization": f"Bearer {GATEWAY_KEYS[team]}",
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError as exc:  # no answer at all: shown in the assertion, not lost in a thread
        return f"{type(exc).__name__}: {exc}"


@pytest.fixture(scope="module")
def scraped_run(
    prometheus: Prometheus,
    vllm_server: RunningServer,
    spec_vllm_server: RunningServer,
    gateway: str,
    collector: Collector,
    events_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Prometheus, float, float]:
    """Bench at vLLM and traffic through the gateway, then repeating prompts at the speculative
    vLLM, all while Prometheus scrapes every second. Returns (prometheus, start, end) of the
    traffic, as unix seconds."""
    folder = tmp_path_factory.mktemp("dash-bench")
    config = folder / "workload.yaml"
    config.write_text(WORKLOAD)
    spec_config = folder / "speculative.yaml"
    spec_config.write_text(SPEC_WORKLOAD)
    start = time.time()
    statuses: dict[str, list[int | str]] = {"alpha": [], "beta": []}
    done = threading.Event()

    def gateway_traffic() -> None:
        # steady traffic across many scrapes: a counter or histogram series that appears and
        # stops within one scrape has no rate to show
        words = "the model reads a long document and writes a short answer about serving " * 4
        i = 0
        while not done.is_set() or i < 5:
            statuses["alpha"].append(_through_gateway(gateway, "alpha", f"{words} {i}"))
            statuses["beta"].append(_through_gateway(gateway, "beta", words))
            with (events_dir / "broken-producer.events.jsonl").open("a") as broken:
                broken.write('{"request_id": "half-written\n')  # for the ingest-error panel
            if i == 3:
                line = collector.restarts_log.read_text().splitlines()[0]
                on = "'enable_prefix_caching': True"
                flipped = (
                    line.replace(on, "'enable_prefix_caching': False")
                    if on in line
                    else line.replace(
                        "non-default args: {", "non-default args: {'enable_prefix_caching': False, "
                    )
                )
                with collector.restarts_log.open("a") as restarts:
                    restarts.write(flipped + "\n")
            i += 1
            time.sleep(0.3)

    traffic = threading.Thread(target=gateway_traffic)
    traffic.start()
    try:
        result = servescope(
            *bench_args(config, vllm_server.url, "run-20261122-dashboards", folder / "s.duckdb"),
            "--json",
        )
    finally:
        done.set()
        traffic.join()
    assert result.returncode == 0, result.stderr[-3000:]
    assert set(statuses["alpha"]) == {200} and set(statuses["beta"]) == {413}, statuses
    spec_run = servescope(
        *bench_args(spec_config, spec_vllm_server.url, "run-20261122-spec", folder / "s.duckdb")
    )
    assert spec_run.returncode == 0, spec_run.stderr[-3000:]
    _settle(prometheus, time.time())  # every target scraped, every rule evaluated, after it
    return prometheus, start, time.time()


def _unix(rfc3339: str) -> float:
    return datetime.fromisoformat(rfc3339).timestamp()


def _settle(prom: Prometheus, traffic_end: float, timeout_s: float = 60.0) -> None:
    """Wait until every target's latest scrape succeeded and began a scrape interval or more
    after the traffic ended (so it holds what a producer recorded just after its last answer),
    and every rule group was evaluated after those scrapes: a window ending now holds the whole
    traffic, however late a busy machine let Prometheus scrape."""
    deadline = time.monotonic() + timeout_s
    targets: list[dict[str, Any]] = []
    scraped_by: float | None = None  # when the last of those scrapes began (then fixed)
    while time.monotonic() < deadline:
        if scraped_by is None:
            targets = prom.get("/api/v1/targets", state="active")["activeTargets"]
            scraped = [_unix(t["lastScrape"]) for t in targets if t["health"] == "up"]
            if len(scraped) == len(targets) and min(scraped) >= traffic_end + SCRAPE_S:
                scraped_by = max(scraped)
        if scraped_by is not None:
            groups = prom.get("/api/v1/rules")["groups"]
            if all(_unix(g["lastEvaluation"]) >= scraped_by for g in groups):
                return
        time.sleep(0.3)
    pytest.fail(f"Prometheus did not scrape every target after the traffic in {timeout_s:.0f} s: "
                f"{[(t['scrapeUrl'], t['health'], t['lastScrape']) for t in targets]}")  # fmt: skip


def _has_data(prom: Prometheus, query: PanelQuery, start: float, end: float) -> bool:
    expr = substitute(query.expr, rate_interval=RATE_INTERVAL, interval=SCRAPE)
    data = prom.get("/api/v1/query_range", query=expr, start=start, end=end, step=1)
    return any(
        math.isfinite(float(value)) for series in data["result"] for _, value in series["values"]
    )


def test_every_panel_query_returns_data(scraped_run: tuple[Prometheus, float, float]) -> None:
    prom, start, end = scraped_run
    awaited = dict(AWAITED)
    for prefix in awaited:
        present = [m for m in prom.get("/api/v1/label/__name__/values") if m.startswith(prefix)]
        assert not present, f"{present} are exported now: drop {prefix!r} from AWAITED"
    empty, unproven = [], []
    for make in DASHBOARDS.values():
        for query in queries(dashboard_json(make)):
            if _has_data(prom, query, start, end):
                continue
            reasons = [why for metric, why in awaited.items() if metric in query.expr]
            (unproven if reasons else empty).append(f"{query.where}: {reasons or query.expr}")
    print("panels not provable yet:\n" + "\n".join(unproven))
    assert not empty, "panel queries that returned no data:\n" + "\n".join(empty)


def test_prefix_cache_hits_were_real(scraped_run: tuple[Prometheus, float, float]) -> None:
    """The shared-prefix workload hit the cache during this run (not earlier in the session)."""
    prom, start, end = scraped_run
    window = f"{math.ceil(end - start)}s"
    query = f"sum(increase(vllm:prefix_cache_hits_total[{window}]))"
    hits = prom.get("/api/v1/query", query=query, time=end)
    assert float(hits["result"][0]["value"][1]) > 0


def test_recording_and_alert_rules_load_and_evaluate(
    scraped_run: tuple[Prometheus, float, float],
) -> None:
    prom, _, _ = scraped_run
    groups = prom.get("/api/v1/rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == 15
    assert not [(r["name"], r.get("lastError")) for r in rules if r.get("health") == "err"]


def test_drafts_were_accepted(scraped_run: tuple[Prometheus, float, float]) -> None:
    """The speculative vLLM proposed drafts during this run and accepted most of them: the
    acceptance panel shows a real rate, not a 0/0."""
    prom, start, end = scraped_run
    window = f"{math.ceil(end - start)}s"

    def total(metric: str) -> float:
        found = prom.get("/api/v1/query", query=f"sum(increase({metric}[{window}]))", time=end)
        return float(found["result"][0]["value"][1])

    drafted = total("vllm:spec_decode_num_draft_tokens_total")
    assert drafted > 0
    assert total("vllm:spec_decode_num_accepted_tokens_total") / drafted > 0.5


def test_lever_flip_annotation_marks_the_flip(
    scraped_run: tuple[Prometheus, float, float],
) -> None:
    prom, start, end = scraped_run
    for make in DASHBOARDS.values():
        (query,) = annotation_queries(dashboard_json(make))
        expr = substitute(query.expr, rate_interval=RATE_INTERVAL, interval=SCRAPE)
        data = prom.get("/api/v1/query_range", query=expr, start=start, end=end, step=1)
        flips = {(s["metric"]["lever"], s["metric"]["after"]) for s in data["result"]}
        assert ("enable_prefix_caching", "false") in flips, (query.where, data["result"])
