"""vLLM's log as a GPU server writes it: the access lines of the CUDA build carry a process
prefix (`(APIServer pid=639) INFO:     …`), and its start-up phases (model loading, compilation,
CUDA graphs, engine init, KV memory) are each one line. The collector reads both; `collect
--once` on a whole GPU log counts refused requests and records each session's cold start.

`tests/fixtures/gpu/vllm-h100.log` is hand-written until recorded (see its README): what this
test expects is derived from the file itself, so the H100 recording replaces it unchanged."""

from __future__ import annotations

import json

import pytest

from servescope.wire.vllm_log import (
    Access,
    Phase,
    Startup,
    add_phase,
    cold_start_from_log,
    parse_line,
)
from tests.helpers.lines import GPU_LOG

PREFIXED = '(APIServer pid=639) INFO:     127.0.0.1:58986 - "POST /v1/completions HTTP/1.1" 400 Bad Request'  # noqa: E501


def test_an_access_line_with_a_process_prefix_is_an_access() -> None:
    assert parse_line(PREFIXED.encode(), year=2026) == Access("POST", "/v1/completions", 400)
    plain = 'INFO:     127.0.0.1:58986 - "GET /health HTTP/1.1" 200 OK'
    assert parse_line(plain.encode(), year=2026) == Access("GET", "/health", 200)
    other = '(APIServer_1 pid=12) INFO:     10.0.0.2:1 - "POST /v1/chat/completions HTTP/1.1" 503'
    assert parse_line(other.encode(), year=2026) == Access("POST", "/v1/chat/completions", 503)
    # a prefix alone, or a broken one, is no access
    waiting = b"(APIServer pid=639) INFO:     Waiting for application startup."
    assert parse_line(waiting, year=2026) is None
    broken = b'(APIServer pid=639 INFO:  1.2.3.4:5 - "POST /v1/completions HTTP/1.1" 400'
    assert parse_line(broken, year=2026) is None


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("Model loading took 13.01 GiB memory and 2.310457 seconds",
         {"model_load_gib": 13.01, "model_load_s": 2.310457}),
        ("Model loading took 13.01 GiB and 2.31 seconds",
         {"model_load_gib": 13.01, "model_load_s": 2.31}),
        ("Compiling a graph for compile range (1, 8192) takes 12.91 s", {"graph_compile_s": 12.91}),
        ("Directly load the compiled graph(s) for compile range (1, 8192) from the cache, "
         "took 1.873 s", {"compile_cache_load_s": 1.873}),
        ("torch.compile took 28.28 s in total", {"torch_compile_s": 28.28}),
        ("torch.compile takes 28.28 s in total", {"torch_compile_s": 28.28}),
        ("torch.compile and initial profiling/warmup run together took 3.5 s in total",
         {"torch_compile_s": 3.5}),
        ("Graph capturing finished in 8 secs, took 0.98 GiB",
         {"cudagraph_capture_s": 8.0, "cudagraph_gib": 0.98}),
        ("init engine (profile, create kv cache, warmup model) took 58.64 s (compilation: 28.28 s)",
         {"init_engine_s": 58.64, "init_engine_compile_s": 28.28}),
        ("init engine (profile, create kv cache, warmup model) took 10.45 s",
         {"init_engine_s": 10.45}),
        ("init engine (profile, create kv cache, warmup model) took 58.64 seconds",
         {"init_engine_s": 58.64}),
        ("Available KV cache memory: 53.14 GiB", {"kv_cache_available_gib": 53.14}),
        ("Estimated CUDA graph memory: 0.61 GiB total", {"cudagraph_estimate_gib": 0.61}),
        ("Loading weights took 0.01 seconds", {"weights_load_s": 0.01}),
        ("Initial profiling/warmup run took 0.55 s", {"profile_run_s": 0.55}),
        ("[backbone] Initial profiling/warmup run took 0.07 s", {"profile_run_s": 0.07}),
        ("Memory profiling takes 4.21 seconds. Total non KV cache memory: 14.17GiB; torch peak "
         "memory increase: 0.79GiB; non-torch forward increase memory: 0.37GiB; weights memory: "
         "13.01GiB.", {"memory_profiling_s": 4.21, "non_kv_cache_gib": 14.17,
                       "activation_peak_gib": 0.79, "non_torch_gib": 0.37, "weights_gib": 13.01}),
    ],
)  # fmt: skip
def test_start_up_phases(message: str, expected: dict[str, float]) -> None:
    line = f"(Worker pid=811) INFO 11-25 14:10:15 [x.py:1] {message}"
    item = parse_line(line.encode(), year=2026)
    assert isinstance(item, Phase) and item.values == expected and not item.ready
    assert item.ts is not None and item.ts.minute == 10


def test_application_startup_complete_marks_ready_in_both_formats() -> None:
    for line in ("(APIServer pid=639) INFO:     Application startup complete.",
                 "INFO:     Application startup complete."):  # fmt: skip
        assert parse_line(line.encode(), year=2026) == Phase(None, {}, ready=True)
    as_json = json.dumps({"asctime": "2026-11-25 14:11:02,120", "name": "uvicorn.error",
                          "message": "Application startup complete."})  # fmt: skip
    item = parse_line(as_json.encode(), year=2000)
    assert isinstance(item, Phase) and item.ready and item.ts is not None


def test_compile_ranges_add_up_and_a_later_start_begins_afresh() -> None:
    once = add_phase({}, {"graph_compile_s": 12.91, "torch_compile_s": 20.0})
    twice = add_phase(once, {"graph_compile_s": 2.09, "torch_compile_s": 28.28})
    assert twice == {"graph_compile_s": 15.0, "torch_compile_s": 28.28}
    text = GPU_LOG.read_text()
    last = cold_start_from_log(text, year=2026)
    starts = [i for i, line in enumerate(text.splitlines())
              if isinstance(parse_line(line.encode(), year=2026), Startup)
              and "version" in line]  # fmt: skip
    assert len(starts) >= 2
    only_last = "\n".join(text.splitlines()[starts[-1] :])
    assert last == cold_start_from_log(only_last, year=2026)
    assert last["ready_s"] > 0 and last["kv_cache_available_gib"] > 0
