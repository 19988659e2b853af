"""The gateway's config, scheduler and timing feed on their own (no server needed: pure asyncio,
YAML and bytes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servescope.gateway.timing import RelayTiming
from servescope.wire.stream import CHAT, COMPLETIONS, StreamTiming
from tests.helpers.cli import servescope


def test_cli_refuses_a_bad_config_with_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "gateway.yaml"
    bad.write_text("upstreams: {u: {url: 'ftp://x'}}\nteams: {a: {keys: [k]}}\n")
    result = servescope("gateway", "--config", str(bad), timeout=120)
    assert result.returncode == 2 and "must be an http:// URL" in result.stderr
    result = servescope("gateway", "--config", str(tmp_path / "missing.yaml"), timeout=120)
    assert result.returncode == 2
    good = tmp_path / "ok.yaml"
    good.write_text(
        "upstreams: {u: {url: 'http://127.0.0.1:9', model: m}}\nteams: {a: {keys: [k]}}\n"
    )
    assert servescope("gateway", "--config", str(good), "--check", timeout=120).returncode == 0


def _message(draw: st.DrawFn, chat: bool, stream_id: str, compact: bool, ascii_: bool) -> bytes:
    """One SSE line as a server might send it: mostly one-token messages like vLLM's, sometimes
    anything else the rules care about (finish reason, usage, errors, several choices, empty or
    escaped text), sometimes not JSON at all."""
    kind = draw(
        st.sampled_from(["token"] * 6 + ["finish", "usage", "error", "two", "empty", "bad", "ping"])
    )
    if kind == "ping":
        return b": ping"
    text = draw(st.text(max_size=6) | st.sampled_from(["a", " the", "\n", '"', "\\", "é", "\x01"]))
    if kind == "empty":
        text = ""

    def choice(i: int, finish: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {"delta": {"content": text}} if chat else {"text": text}
        return {"index": i, **body, "logprobs": None, "finish_reason": finish}

    doc: dict[str, Any] = {"id": stream_id, "object": "chunk", "created": 1, "model": "m"}
    if kind == "usage":
        doc.update(choices=[], usage={"prompt_tokens": 3, "completion_tokens": 2})
    elif kind == "error":
        doc = {"error": {"message": text, "code": 500}}
    else:
        finish = "stop" if kind == "finish" else None
        doc.update(choices=[choice(i, finish) for i in range(2 if kind == "two" else 1)])
        doc["usage"] = None
    separators = (",", ":") if compact else (", ", ": ")
    raw = b"data: " + json.dumps(doc, separators=separators, ensure_ascii=ascii_).encode()
    return raw[: len(raw) // 2] if kind == "bad" else raw


@st.composite
def _streams(draw: st.DrawFn) -> tuple[bool, list[bytes]]:
    chat = draw(st.booleans())
    compact, ascii_ = draw(st.booleans()), draw(st.booleans())
    ids = draw(st.sampled_from([["cmpl-1"], ["cmpl-1", "cmpl-2"]]))  # an id that changes
    lines = [
        _message(draw, chat, draw(st.sampled_from(ids)), compact, ascii_)
        for _ in range(draw(st.integers(0, 30)))
    ]
    return chat, [*lines, b"data: [DONE]"]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_streams())
def test_relay_timing_equals_the_bench_timing_rules(stream: tuple[bool, list[bytes]]) -> None:
    """`gateway.timing.RelayTiming` skips decoding the messages it can prove are plain tokens;
    whatever the stream, it concludes what `wire.stream.StreamTiming` concludes."""
    chat, lines = stream
    endpoint = CHAT if chat else COMPLETIONS
    ours, theirs = RelayTiming(endpoint, 0.0), StreamTiming(endpoint, 0.0)
    for i, line in enumerate(lines):
        try:
            chunk = theirs.feed_line(line, 1.0 + i)
            error = chunk.get("error") if chunk is not None else None
        except ValueError:  # the relay passes such a line on untimed
            error = None
        assert ours.feed(line + b"\n\n", 1.0 + i) == error
    for name in ("first", "last", "gaps", "usage", "finish_reason", "done"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.finish({}, 99.0) == theirs.finish({}, 99.0)
