"""An agent runtime's lines, as one of its .events.jsonl files holds them between requests."""

from __future__ import annotations

import json
from pathlib import Path

RUN = "run-20260512"
TRACE = "0af7651916cd43dd8448eb211c80319c"


LINES = [
    {"type": "session_start", "run_id": RUN, "ts": "2026-05-12T09:59:59Z", "agent": "ralph"},
    {
        "request_id": f"{RUN}-001",
        "ts": "2026-05-12T10:00:00Z",
        "model": "local-coder",
        "prompt_tokens": 1842,
        "completion_tokens": 419,
        "ttft_ms": 820,
        "tpot_ms": 34,
        "cache_hit": True,
        "finish_reason": "stop",
    },
    {
        "type": "tool_call",
        "run_id": RUN,
        "ts": "2026-05-12T10:00:03Z",
        "request_id": f"{RUN}-001",
        "tool": "pytest",
        "args": {"k": "test_x", "n": 1.0},
    },
    # the same tool call twice is two events, not one
    {
        "type": "tool_call",
        "run_id": RUN,
        "ts": "2026-05-12T10:00:03Z",
        "request_id": f"{RUN}-001",
        "tool": "pytest",
        "args": {"k": "test_x", "n": 1.0},
    },
    {
        "request_id": f"{RUN}-002",
        "ts": "2026-05-12T10:00:05Z",
        "ttft_ms": 120.5,
        "finish_reason": "stop",
        "trace_id": TRACE,
    },
    {"type": "approval", "run_id": RUN, "trace_id": TRACE, "approved": True, "by": "é"},
]


def write_lines(path: Path, docs: list[dict]) -> str:
    text = "".join(json.dumps(doc, ensure_ascii=False) + "\n" for doc in docs)
    path.write_text(text, encoding="utf-8")
    return text
