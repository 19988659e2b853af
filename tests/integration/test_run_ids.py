"""Run ids unique across nodes (issue #33, item 5): a server session's run is named from its
model, its collector's instance (`collect --instance`, default the host name), its port and its
start. Two nodes that start the same model on the same port in the same second, each with its
sidecar, stay two runs once their rows meet in one store, each with its own levers; a restart
pairs (one lever flip, `--vs previous`) only with a session of its own instance, even where two
hosts took turns with one store and their logs have one path; a store written before instances
keeps its ids, and the first restart after the upgrade still pairs with the old-format run."""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime
from pathlib import Path

import duckdb

from servescope.collector import Collector
from servescope.collector.sessions import default_instance, instance_name, session_run_id
from servescope.collector.sources.logs import VllmLog
from servescope.store import Store
from tests.helpers.cli import servescope
from tests.helpers.stored import rows

QWEN3 = Path(__file__).resolve().parents[1] / "fixtures" / "gpu2" / "vllm-qwen3.log"
# vllm-qwen3.log: one server, qwen3-8b-dummy on the default port 8000, started 11-27 00:13:17
STAMP = "8000-20261127T001317Z"
SHARED_TABLES = ("runs", "events", "lever_flips", "metric_samples")


def _server_log(port: int, minute: int, caching: bool, requests: list[str]) -> list[str]:
    """One server lifetime as vLLM 0.32 logs it: banner, args, listening line, requests,
    shutdown."""
    head = f"(APIServer pid={port}) INFO 11-24 20:{minute:02d}"
    lines = [
        f"{head}:01 [api_utils.py:347]   █▄█▀ █     █     █     █  version 0.32.0",
        f"{head}:01 [api_utils.py:286] non-default args: {{'port': {port}, 'model': "
        f"'/models/tiny', 'served_model_name': ['tiny'], 'enable_prefix_caching': {caching}}}",
        f"{head}:30 [entry.py:140] Starting vLLM server on http://0.0.0.0:{port}",
    ]
    for i, rid in enumerate(requests):
        lines += [
            f"{head}:{40 + i:02d} [request_logger.py:65] Received request cmpl-{rid}-0: params: "
            "SamplingParams(n=1, max_tokens=8), lora_request: None.",
            f"{head}:{40 + i:02d} [async_llm.py:578] Added request cmpl-{rid}-0-0a1b2c3d.",
        ]
    return [*lines, f"{head}:59 [launcher.py:254] [shutdown] API server: shutdown triggered"]


def _write(path: Path, *sessions: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(line for lines in sessions for line in lines) + "\n")
    return path


def _collect(instance: str, log: Path, store: Path) -> None:
    servescope("collect", "--once", "--instance", instance, "--vllm-log", str(log),
               "--store", str(store), check=True)  # fmt: skip


def _share(parts: list[Path], shared: Path) -> None:
    """The rows of several sidecars' stores in one store, as a shared lake holds them."""
    with Store(shared).write():
        pass  # the schema
    with duckdb.connect(str(shared)) as con:
        for i, part in enumerate(parts):
            con.execute(f"ATTACH '{part}' AS part{i} (READ_ONLY)")
            for table in SHARED_TABLES:
                con.execute(f"INSERT INTO {table} SELECT * FROM part{i}.{table}")  # noqa: S608
            con.execute(f"DETACH part{i}")


def _runs(store: Path) -> dict[str, dict]:
    listing = servescope("report", "list", "--json", "--store", str(store), check=True)
    return {r["run_id"]: r for r in json.loads(listing.stdout) if r["run_id"].startswith("vllm-")}


def test_the_instance_goes_into_the_id_between_model_and_port() -> None:
    started = datetime(2026, 11, 27, 0, 13, 17, tzinfo=UTC)
    assert session_run_id("qwen3-8b-dummy", 8000, started, "gpu-node-7.dc1") == (
        "vllm-qwen3-8b-dummy-gpu-node-7.dc1-8000-20261127T001317Z"
    )
    assert session_run_id("org/model", 8000, started, "my host") == (
        "vllm-org-model-my-host-8000-20261127T001317Z"
    )
    # no instance (the library's Collector given none): the spelling of older stores
    assert session_run_id("tiny", 8000, started) == "vllm-tiny-8000-20261127T001317Z"
    assert instance_name("  pod/web:1 ") == "pod-web-1" and instance_name("//") == ""
    assert default_instance() and instance_name(default_instance()) == default_instance()


def test_two_hosts_same_model_port_and_second_stay_two_runs_with_their_own_levers(
    tmp_path: Path,
) -> None:
    """The recorded qwen3 server, started on two nodes at once: node b's with another memory
    fraction. Each sidecar names its session after its host; in one store they are two runs,
    each with its levers and its requests, and no flip goes between them."""
    log_a = tmp_path / "node-a" / "vllm.log"
    log_a.parent.mkdir()
    shutil.copy(QWEN3, log_a)
    text = QWEN3.read_text()
    assert "'gpu_memory_utilization': 0.85" in text
    log_b = tmp_path / "node-b" / "vllm.log"
    log_b.parent.mkdir()
    log_b.write_text(
        text.replace("'gpu_memory_utilization': 0.85", "'gpu_memory_utilization': 0.9")
    )
    store_a, store_b = tmp_path / "a.duckdb", tmp_path / "b.duckdb"
    _collect("node-a", log_a, store_a)
    _collect("node-b", log_b, store_b)
    run_a = f"vllm-qwen3-8b-dummy-node-a-{STAMP}"
    run_b = f"vllm-qwen3-8b-dummy-node-b-{STAMP}"
    alone_a, alone_b = _runs(store_a), _runs(store_b)
    assert list(alone_a) == [run_a] and list(alone_b) == [run_b]
    requests = alone_a[run_a]["events"]
    assert requests > 20  # its 20 requests and the refused ones

    shared = tmp_path / "shared.duckdb"
    _share([store_a, store_b], shared)
    runs = _runs(shared)
    assert sorted(runs) == [run_a, run_b]
    assert runs[run_a]["levers"]["gpu_memory_utilization"] == 0.85
    assert runs[run_b]["levers"]["gpu_memory_utilization"] == 0.9
    assert runs[run_a]["events"] == runs[run_b]["events"] == requests
    assert runs[run_a]["target"] == runs[run_b]["target"] == "http://127.0.0.1:8000"
    notes = dict(rows(shared, "SELECT run_id, notes FROM runs"))
    assert {json.loads(notes[r])["instance"] for r in (run_a, run_b)} == {"node-a", "node-b"}
    assert rows(shared, "SELECT count(*) FROM lever_flips") == [(0,)]
    sessions = rows(shared, "SELECT run_id, count(DISTINCT vllm_session) FROM events GROUP BY 1")
    assert sorted(sessions) == [(run_a, 1), (run_b, 1)]

    # the reports read them apart: node b against node a, and neither follows the other
    built = servescope("report", "build", run_b, "--vs", run_a, "--format", "json",
                       "--out", str(tmp_path / "reports"), "--store", str(shared), "--json",
                       check=True)  # fmt: skip
    report = json.loads(Path(json.loads(built.stdout)["paths"][0]).read_text())
    assert (report["run_id"], report["base_run_id"]) == (run_b, run_a)
    overall = (report["before"]["overall"], report["after"]["overall"])
    assert overall[0]["requests"] == overall[1]["requests"] == requests
    for run in (run_a, run_b):
        alone = servescope("report", "build", run, "--vs", "previous", "--store", str(shared))
        assert alone.returncode == 2 and "follows no other run" in alone.stderr, alone.stderr


def test_a_restart_pairs_only_with_a_session_of_its_own_host(tmp_path: Path) -> None:
    """Node a restarts its server with prefix caching on; node b starts the same model on the
    same port at the same second as node a's first start, and again later. Node a's flip goes
    from its first session to its second, never to or from node b's; a client run whose
    requests both nodes served names both sessions."""
    log_a = _write(tmp_path / "node-a" / "vllm.log",
                   _server_log(8001, 10, False, ["1a2b3c4d5e6f7a8b", "fleet-000001"]),
                   _server_log(8001, 20, True, ["2a2b3c4d5e6f7a8b"]))  # fmt: skip
    log_b = _write(tmp_path / "node-b" / "vllm.log",
                   _server_log(8001, 10, True, ["3a2b3c4d5e6f7a8b", "fleet-000002"]),
                   _server_log(8001, 30, True, ["4a2b3c4d5e6f7a8b"]))  # fmt: skip
    store_a, store_b, shared = (tmp_path / f"{n}.duckdb" for n in ("a", "b", "shared"))
    _collect("node-a", log_a, store_a)
    _collect("node-b", log_b, store_b)
    _share([store_a, store_b], shared)
    a1, a2 = "vllm-tiny-node-a-8001-20261124T201001Z", "vllm-tiny-node-a-8001-20261124T202001Z"
    b1, b2 = "vllm-tiny-node-b-8001-20261124T201001Z", "vllm-tiny-node-b-8001-20261124T203001Z"
    assert sorted(_runs(shared)) == [a1, a2, b1, b2]
    flips = rows(shared, "SELECT lever, before, after, before_run_id, run_id FROM lever_flips")
    assert flips == [("enable_prefix_caching", "false", "true", a1, a2)]  # b's restart: no flip
    notes = rows(shared, "SELECT run_id, notes FROM runs")
    previous = {run: json.loads(text).get("previous") for run, text in notes}
    assert previous == {a1: None, a2: a1, b1: None, b2: b1}
    served = rows(shared, "SELECT vllm_session FROM events WHERE run_id = 'fleet' ORDER BY 1")
    assert served == [(a1,), (b1,)]
    for after, before in ((a2, a1), (b2, b1)):
        built = servescope("report", "build", after, "--vs", "previous", "--format", "json",
                           "--out", str(tmp_path / "reports"), "--store", str(shared), "--json",
                           check=True)  # fmt: skip
        report = json.loads(Path(json.loads(built.stdout)["paths"][0]).read_text())
        assert report["base_run_id"] == before


def test_hosts_taking_turns_with_one_store_never_pair_across_hosts(tmp_path: Path) -> None:
    """One store on a shared disk, written by node a's sidecar and then node b's, their logs at
    one path: the log's checkpoint in that store holds node a's last session, and node b's
    start is not node a's restart — no flip, no `previous`, and `--vs previous` finds no
    earlier run of node b at the shared target URL either."""
    log, store = tmp_path / "var-log" / "vllm.log", tmp_path / "shared.duckdb"
    _write(log, _server_log(8001, 10, False, ["1a2b3c4d5e6f7a8b"]))
    _collect("node-a", log, store)
    log.unlink()  # node b's log, at the same path
    _write(log, _server_log(8001, 20, True, ["2a2b3c4d5e6f7a8b"]))
    _collect("node-b", log, store)
    a1, b1 = "vllm-tiny-node-a-8001-20261124T201001Z", "vllm-tiny-node-b-8001-20261124T202001Z"
    assert sorted(_runs(store)) == [a1, b1]
    assert rows(store, "SELECT count(*) FROM lever_flips") == [(0,)]
    notes = dict(rows(store, "SELECT run_id, notes FROM runs"))
    assert json.loads(notes[b1])["previous"] is None
    alone = servescope("report", "build", b1, "--vs", "previous", "--store", str(store))
    assert alone.returncode == 2 and "follows no other run" in alone.stderr, alone.stderr


def test_an_older_stores_ids_stay_and_the_first_restart_after_upgrading_pairs(
    tmp_path: Path,
) -> None:
    """A session a collector without instances recorded keeps its id; the server's restart,
    read by the upgraded sidecar from the same log and store, is named with the instance and
    is that session's successor (the log's checkpoint was written on this host)."""
    log, store = tmp_path / "vllm.log", tmp_path / "s.duckdb"
    _write(log, _server_log(8001, 10, False, ["1a2b3c4d5e6f7a8b"]))
    Collector(Store(store), [VllmLog(str(log))], once=True).run_once()  # before instances
    old = "vllm-tiny-8001-20261124T201001Z"
    assert list(_runs(store)) == [old]
    with log.open("a") as out:
        out.write("\n".join(_server_log(8001, 20, True, ["2a2b3c4d5e6f7a8b"])) + "\n")
    _collect("node-a", log, store)
    new = "vllm-tiny-node-a-8001-20261124T202001Z"
    runs = _runs(store)
    assert sorted(runs) == sorted([old, new]) and runs[old]["events"] == runs[new]["events"] == 1
    flips = rows(store, "SELECT lever, before, after, before_run_id, run_id FROM lever_flips")
    assert flips == [("enable_prefix_caching", "false", "true", old, new)]
    notes = dict(rows(store, "SELECT run_id, notes FROM runs"))
    assert "instance" not in json.loads(notes[old])
    assert json.loads(notes[new])["instance"] == "node-a"
