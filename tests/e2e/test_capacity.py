"""`servescope capacity`: the KV-cache arithmetic against hand computations on three public model
configs, and against what a real vLLM states at start-up for the tiny model (the session's
server, whose log holds the line); the launcher and the collector record that statement."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pytest

from servescope.store import settings
from servescope.wire.kv_statement import kv_cache_from_log
from tests.helpers.cli import capacity, servescope
from tests.helpers.vllm import RunningServer


def test_tiny_model_matches_what_real_vllm_states(
    vllm_server: RunningServer, tiny_model: Path, tmp_path: Path
) -> None:
    stated = kv_cache_from_log(vllm_server.log.read_text(errors="replace"))
    assert stated is not None, "vLLM logged no KV-cache statement"
    # the session server: the default profile (float32, max-model-len 16384, 1 GiB of KV space)
    ours = capacity(tiny_model, tmp_path, "--dtype", "float32", "--kv-cache-gib", "1",
                    "--max-model-len", str(stated["max_model_len"]))  # fmt: skip
    assert stated["max_model_len"] == 16384
    assert ours["kv_bytes_per_token"] == 2 * 2 * 2 * 64 * 4 == 2048
    assert ours["kv_tokens"] == stated["kv_cache_tokens"] == 524_288
    assert ours["max_concurrency"] == pytest.approx(stated["max_concurrency"], abs=0.005)

    state = json.loads((settings.servers_dir() / f"{vllm_server.port}.json").read_text())
    assert state["kv_cache"]["vllm"] == stated
    recorded = state["kv_cache"]["servescope"]
    assert recorded["kv_tokens"] == stated["kv_cache_tokens"]
    assert recorded["max_concurrency"] == pytest.approx(stated["max_concurrency"], abs=0.005)


def test_the_collector_records_the_statement(vllm_server: RunningServer, tmp_path: Path) -> None:
    """The collector's log parser reads the statement into the server session's run: its
    `notes.kv_cache.vllm`, and samples of that run."""
    store = tmp_path / "s.duckdb"
    servescope("collect", "--once", "--vllm-log", str(vllm_server.log), "--store", str(store),
               "--metrics-port", "0", check=True)  # fmt: skip
    stated = kv_cache_from_log(vllm_server.log.read_text(errors="replace"))
    assert stated is not None
    with duckdb.connect(str(store), read_only=True) as con:
        samples = {name: (value, run) for name, value, run in con.execute(
            "SELECT name, value, run_id FROM metric_samples "
            "WHERE name IN ('vllm_log:kv_cache_tokens', 'vllm_log:max_concurrency')"
        ).fetchall()}  # fmt: skip
        notes = [json.loads(n) for (n,) in con.execute(
            "SELECT notes FROM runs WHERE run_id = $run", {"run": samples[
                "vllm_log:kv_cache_tokens"][1]}).fetchall()]  # fmt: skip
    assert samples["vllm_log:kv_cache_tokens"][0] == stated["kv_cache_tokens"]
    assert samples["vllm_log:max_concurrency"][0] == stated["max_concurrency"]
    (session,) = notes
    assert session["kind"] == "vllm-session" and session["kv_cache"]["vllm"] == stated
