"""vLLM's log as a GPU server writes it: the access lines of the CUDA build carry a process
prefix (`(APIServer pid=639) INFO:     …`), and its start-up phases (model loading, compilation,
CUDA graphs, engine init, KV memory) are each one line. The collector reads both; `collect
--once` on a whole GPU log counts refused requests and records each session's cold start.

`tests/fixtures/gpu/vllm-h100.log` is hand-written until recorded (see its README): what this
test expects is derived from the file itself, so the H100 recording replaces it unchanged."""

from __future__ import annotations

import json
import re
from pathlib import Path

import duckdb

from tests.helpers.cli import servescope
from tests.helpers.lines import GPU_LOG


def _refused_in(text: str) -> int:
    """4xx/5xx access lines answering an inference path: counted without the parser."""
    return len(re.findall(r'"POST /v1/(?:chat/)?completions HTTP/[\d.]+" [45]\d\d ', text))


def test_collect_once_on_a_gpu_server_log_counts_refusals_and_cold_starts(tmp_path: Path) -> None:
    store = tmp_path / "s.duckdb"
    servescope("collect", "--once", "--vllm-log", str(GPU_LOG), "--store", str(store), check=True)
    text = GPU_LOG.read_text()
    with duckdb.connect(str(store), read_only=True) as con:
        runs = con.execute(
            "SELECT run_id, vllm_version, notes, levers FROM runs ORDER BY started_at"
        ).fetchall()
        refused = con.execute(
            "SELECT count(*) FROM events WHERE status <> 'ok' AND error LIKE 'http_%'"
        ).fetchone()
        flips = con.execute("SELECT lever, before, after FROM lever_flips").fetchall()
    expected_refusals = _refused_in(text)
    assert expected_refusals > 0
    assert refused == (expected_refusals,)
    assert len(runs) >= 2 and all(r[1] for r in runs)
    assert "enable_prefix_caching" in {lever for lever, _before, _after in flips}
    for _run_id, _version, notes, _levers in runs:
        cold = json.loads(notes)["cold_start"]
        assert cold["model_load_gib"] > 0 and cold["init_engine_s"] > 0
        assert cold["kv_cache_available_gib"] > 0 and 0 < cold["ready_s"] < 3600
        assert cold["ready_s"] >= cold["init_engine_s"]  # the engine starts inside the server

    # the report of a session shows its cold start; a diff compares two
    first, second = runs[0][0], runs[1][0]
    out = tmp_path / "reports"
    # from outside the repository, as on a GPU server where servescope is installed: the HTML
    # templates come from the installed package, not from a `reports/` folder in the cwd
    built = servescope("report", "build", second, "--vs", first, "--format", "json,md,html",
                       "--out", str(out), "--store", str(store), "--json", cwd=tmp_path,
                       check=True)  # fmt: skip
    paths = [Path(p) for p in json.loads(built.stdout)["paths"]]
    report = json.loads(next(p for p in paths if p.suffix == ".json").read_text())
    rows = {r["phase"]: r for r in report["cold_start"]}
    assert rows["ready_s"]["before"] == json.loads(runs[0][2])["cold_start"]["ready_s"]
    assert rows["ready_s"]["after"] == json.loads(runs[1][2])["cold_start"]["ready_s"]
    markdown = next(p for p in paths if p.suffix == ".md").read_text()
    assert "Cold start" in markdown
