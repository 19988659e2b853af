"""The HTML report in a real headless Chromium: it renders (a screenshot that is not blank), it
loads nothing but itself, and hostile names from the store show up as text, never as markup.

Chromium is driven over the DevTools protocol, which reports every request the page makes;
the page is served by a local HTTP server started here, whose log must hold the page alone.
Chromium missing is a failure, not a skip.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import http.server
import io
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from PIL import Image

from servescope.store import Store
from tests.helpers.cli import servescope
from tests.helpers.reports import T0, store_run, synthetic_events

HOSTILE = "<script>alert(1)</script>"
HOSTILE_LEVER = '"><img src=x onerror=alert(2)>'


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    requests: list[str]

    def log_message(self, _format: str, *_args: Any) -> None:
        self.requests.append(self.path)


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("html")
    db = folder / "s.duckdb"
    store = Store(db)
    before = synthetic_events("run-h-off", seed=1, ttft_divisor=1, start=T0)
    after = synthetic_events("run-h-on", seed=2, ttft_divisor=5, start=T0 + timedelta(minutes=1))
    for event in before + after:
        event["model"] = HOSTILE
        event["workload"] = HOSTILE
    store_run(store, "run-h-off", before, levers={"enable_prefix_caching": False})
    store_run(store, "run-h-on", after, levers={"enable_prefix_caching": True, "x": HOSTILE_LEVER})
    store.upsert_run("run-h-on", model=HOSTILE)
    store.add_lever_flip(HOSTILE, HOSTILE, HOSTILE_LEVER, run_id="run-h-on", ts=T0)
    out = folder / "reports"
    servescope(
        "report", "build", "run-h-on", "--vs", "run-h-off", "--store", str(db), "--out", str(out),
        "--format", "html", check=True,
    )  # fmt: skip
    return out / "run-h-on-vs-run-h-off"


@pytest.fixture
def served(report_dir: Path) -> Iterator[tuple[str, list[str]]]:
    requests: list[str] = []
    handler = type("Handler", (QuietHandler,), {"requests": requests})
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(handler, directory=str(report_dir))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/index.html", requests
    server.shutdown()
    server.server_close()


async def visit(devtools: str, url: str) -> dict[str, Any]:
    """Open `url` in a page, record its requests and dialogs, then screenshot and inspect it."""
    async with aiohttp.ClientSession() as session:
        # The DevTools port opens before Chromium has made its first page: wait for the page.
        deadline = time.monotonic() + 30
        while True:
            async with session.get(f"{devtools}/json/list") as resp:
                targets = await resp.json()
            page = next((t for t in targets if t["type"] == "page"), None)
            if page is not None:
                break
            assert time.monotonic() < deadline, f"Chromium made no page: {targets}"
            await asyncio.sleep(0.1)
        async with session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            ids = iter(range(1, 10_000))
            requests: list[str] = []
            dialogs: list[str] = []
            loaded = asyncio.Event()

            async def call(method: str, **params: Any) -> dict[str, Any]:
                call_id = next(ids)
                await ws.send_json({"id": call_id, "method": method, "params": params})
                while True:
                    message = await asyncio.wait_for(ws.receive_json(), timeout=60)
                    if message.get("id") == call_id:
                        assert "error" not in message, message
                        return message["result"]
                    event = message.get("method")
                    if event == "Network.requestWillBeSent":
                        requests.append(message["params"]["request"]["url"])
                    elif event == "Page.javascriptDialogOpening":  # a script ran: record it,
                        dialogs.append(message["params"]["message"])  # close it, carry on
                        await ws.send_json(
                            {
                                "id": next(ids),
                                "method": "Page.handleJavaScriptDialog",
                                "params": {"accept": True},
                            }
                        )
                    elif event == "Page.loadEventFired":
                        loaded.set()

            await call("Network.enable")
            await call("Page.enable")
            await call("Page.navigate", url=url)
            while not loaded.is_set():
                await call("Runtime.evaluate", expression="1")
            await asyncio.sleep(0.5)  # anything the page might fetch late

            async def evaluate(expression: str) -> Any:
                result = await call("Runtime.evaluate", expression=expression, returnByValue=True)
                return result["result"].get("value")

            shot = await call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
            return {
                "requests": requests,
                "dialogs": dialogs,
                "png": base64.b64decode(shot["data"]),
                "text": await evaluate("document.body.innerText"),
                "scripts": await evaluate("document.querySelectorAll('script').length"),
                "images": await evaluate("document.querySelectorAll('img').length"),
                "charts": await evaluate(
                    "[...document.querySelectorAll('svg')]"
                    ".filter(s => s.getBoundingClientRect().width > 100).length"
                ),
                "title": await evaluate("document.title"),
            }


def test_html_report_renders_offline_and_shows_hostile_names_as_text(
    chromium: str, served: tuple[str, list[str]], report_dir: Path
) -> None:
    url, served_requests = served
    seen = asyncio.run(visit(chromium, url))

    # loads nothing but itself
    assert seen["requests"] == [url], seen["requests"]
    assert served_requests == ["/index.html"], served_requests
    html = (report_dir / "index.html").read_text()
    for needle in ("<script", '<link rel="stylesheet', "@import", "url(", 'src="http'):
        assert needle not in html, needle

    # hostile strings are text: no script ran, no element was injected
    assert seen["dialogs"] == []
    assert seen["scripts"] == 0 and seen["images"] == 0
    assert HOSTILE in seen["text"]
    assert HOSTILE_LEVER in seen["text"]
    assert "run-h-on" in seen["title"]

    # it rendered: the headline, the diff table, the charts, and a picture that is not blank
    assert "enable_prefix_caching off → on; x unset → " in seen["text"]
    assert "TTFT p50 over all load levels (stratified) improved: −" in seen["text"]
    assert "improved" in seen["text"] and "unchanged" in seen["text"]
    assert seen["charts"] >= 5
    image = Image.open(io.BytesIO(seen["png"])).convert("RGB")
    width, height = image.size
    assert width >= 1000 and height >= 1500
    small = image.resize((width // 4, height // 4))
    raw = small.tobytes()
    pixels = [raw[i : i + 3] for i in range(0, len(raw), 3)]
    ink = sum(1 for p in pixels if sum(p) < 600) / len(pixels)  # not near-white
    colours = len(set(pixels))
    assert ink > 0.01, f"screenshot looks blank: {ink:.4f} of pixels not white"
    assert colours > 50, f"screenshot has only {colours} colours"
    (report_dir / "screenshot.png").write_bytes(seen["png"])
