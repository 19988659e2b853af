"""Experiments without vLLM: servers that answer vLLM's reset and sleep endpoints, a bench that
stores synthetic runs as `bench run` does, and the check that an outcome table is printed whole."""

from __future__ import annotations

import http.server
import json
import random
import threading
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from servescope.loadgen.launcher import (
    ALWAYS_FLAGS,
    OBSERVATION_LEVERS,
    levers_of,
)
from servescope.loadgen.runner import RunOptions, RunResult
from servescope.reports.experiment import OUTCOME_INDICATORS
from servescope.store import Store


class ResetHandler(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802
        server: ResetServer = self.server  # type: ignore[assignment]
        path = self.path.partition("?")[0]
        server.calls.append((server.name, self.path))
        if path in ("/sleep", "/wake_up"):
            if not (server.dev_mode and server.sleep_mode):
                self._answer(404 if not server.dev_mode else 500, {})
                return
            server.asleep = path == "/sleep"
            self._answer(200, None)
            return
        server.resets += 1
        if not server.dev_mode:
            self._answer(404, {})
            return
        self._answer(200, {"success": server.resets > server.refuse_first})

    def do_GET(self) -> None:  # noqa: N802
        server: ResetServer = self.server  # type: ignore[assignment]
        if self.path != "/is_sleeping" or not server.dev_mode:
            self._answer(404, {})
            return
        self._answer(200, {"is_sleeping": server.asleep})

    def _answer(self, code: int, answer: dict[str, Any] | None) -> None:
        body = b"" if answer is None else json.dumps(answer).encode()  # /sleep: an empty 200
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class ResetServer(http.server.ThreadingHTTPServer):
    def __init__(
        self,
        dev_mode: bool = True,
        refuse_first: int = 0,
        *,
        sleep_mode: bool = False,
        name: str = "",
        calls: list[tuple[str, str]] | None = None,
    ) -> None:
        super().__init__(("127.0.0.1", 0), ResetHandler)
        self.dev_mode, self.refuse_first, self.resets = dev_mode, refuse_first, 0
        self.sleep_mode, self.asleep, self.name = sleep_mode, False, name
        self.calls = calls if calls is not None else []  # (name, POST path) in arrival order
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class FakeServer:
    """VllmServer's surface, answering the reset endpoint (and the sleep ones when started with
    `--enable-sleep-mode`); counts its starts. `calls` keeps every server's starts and POSTs in
    the order they came: (profile, "start" or the path)."""

    made: list[FakeServer] = []
    calls: list[tuple[str, str]] = []

    def __init__(self, _model: Any, *, profile: Any, port: int, extra_flags: list[str],
                 env: dict[str, str], log_path: Path | None) -> None:  # fmt: skip
        self.profile, self.port, self.env, self.log_path = profile, port, env, log_path
        self.flags = profile.flags + list(extra_flags)
        self.http = ResetServer(
            dev_mode=env.get("VLLM_SERVER_DEV_MODE") == "1",
            sleep_mode="--enable-sleep-mode" in self.flags,
            name=profile.name,
            calls=FakeServer.calls,
        )
        self.url = self.http.url
        self.starts = self.stops = 0
        self.ready_s: float | None = None
        FakeServer.made.append(self)

    @property
    def levers(self) -> dict[str, Any]:
        levers = levers_of(ALWAYS_FLAGS + self.flags)
        return {k: v for k, v in levers.items() if k not in OBSERVATION_LEVERS}

    def start(self) -> FakeServer:
        FakeServer.calls.append((self.profile.name, "start"))
        self.starts += 1
        self.ready_s = 0.5
        return self

    def stop(self) -> None:
        self.stops += 1


START = datetime(2026, 11, 26, 9, 0, 0)
TTFT_MS = {"no-prefix-caching": 600.0, "default": 100.0}  # per profile; others 300


class FakeBench:
    """The Executor: stores each run's requests (TTFT by profile, a drift over the rounds) and
    its `runs` row with the levers and notes it was given, as `bench run` does."""

    def __init__(self, store: Store, levers: dict[str, dict[str, Any]] | None = None) -> None:
        self.store = store
        self.calls: list[tuple[str, RunOptions]] = []
        self.levers = levers or {}

    def __call__(self, _config: Any, target: str, store: Store, options: RunOptions) -> Any:
        run_id, notes = options.run_id, options.notes
        self.calls.append((target, options))
        position = len(self.calls)
        rng = random.Random(position)
        start = START + timedelta(minutes=position)
        base = TTFT_MS.get(notes["profile"], 300.0) + 5.0 * position  # a linear drift
        events = []
        for i in range(40):
            ttft = base * rng.lognormvariate(0.0, 0.1)
            events.append(
                {
                    "request_id": f"{run_id}-{i + 1:06d}",
                    "run_id": run_id,
                    "ts": (start + timedelta(milliseconds=200 * i)).isoformat() + "Z",
                    "model": "tiny",
                    "workload": "mixed:probe" if i % 2 else "mixed:long",
                    "concurrency": 1,
                    "request_class": "probe" if i % 2 else "long",
                    "prompt_tokens": 512,
                    "completion_tokens": 16,
                    "cached_tokens": 256 if notes["profile"] == "default" else 0,
                    "ttft_ms": ttft,
                    "tpot_ms": 3.0 + rng.random(),
                    "e2e_ms": ttft + 60.0,
                    "status": "ok",
                    "finish_reason": "length",
                }
            )
        store.add_events(events)
        store.upsert_run(
            run_id,
            model="tiny",
            label=options.label,
            target=target,
            levers=self.levers.get(notes["arm"], {}),
            notes=notes,
            started_at=start,
            ended_at=start + timedelta(seconds=10),
            status="complete",
        )
        return RunResult(run_id, Path("unused"), events=len(events))


def whole(text: str, indicators: list[tuple[str, str, str]] = OUTCOME_INDICATORS) -> None:
    """Every heading of the outcome table whole, nothing cut short, nothing past 80 columns."""
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= 80, text
    for heading, _key, _spec in indicators:
        assert heading in text, (heading, text)
