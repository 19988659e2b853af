"""Lines as the tests' inputs hold them: the seed format's event line, vLLM's log lines as vLLM 0.32
writes them (text format), and a GPU server's log (tests/fixtures/gpu/)."""

from __future__ import annotations

from pathlib import Path

SEED_LINE = (
    '{"request_id": "run-20260512-001", "model": "local-coder", "prompt_tokens": 1842, '
    '"completion_tokens": 419, "ttft_ms": 820, "tpot_ms": 34, "cache_hit": true, '
    '"finish_reason": "stop"}'
)


# Lines as vLLM 0.32 writes them (from a real server log, text format).
RECEIVED = (
    "(APIServer pid=6485) INFO 11-22 04:29:59 [request_logger.py:65] Received request "
    "cmpl-h3probe-000001-0: params: SamplingParams(n=1, presence_penalty=0.0, temperature=1.0, "
    "max_tokens=5, min_tokens=0), lora_request: None."
)
ADDED = (
    "(APIServer pid=6485) INFO 11-22 04:29:59 [async_llm.py:578] Added request "
    "cmpl-h3probe-000001-0-88bc5d5c."
)
ACCESS = 'INFO:     127.0.0.1:41836 - "POST /v1/completions HTTP/1.1" 200 OK'
LEVERS = (
    "(APIServer pid=6485) INFO 11-22 04:28:02 [api_utils.py:286] non-default args: "
    "{'enable_prompt_tokens_details': True, 'host': '127.0.0.1', 'port': 8100, 'model': "
    "'servescope-data/models/tiny', 'dtype': 'float32', 'max_model_len': 16384, "
    "'served_model_name': ['tiny'], 'enable_log_requests': True}"
)


GPU_LOG = Path(__file__).resolve().parents[1] / "fixtures" / "gpu" / "vllm-h100.log"
