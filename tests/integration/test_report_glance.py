"""A comparison's HTML report read at a glance (issue 41): the decision and a forest plot of the
core indicators on the first screen, the full table folded, and a page that fits 1,280 px.

A real pooled report (five repeats a side, a true −25 % TTFT: tests/helpers/calibration.py, written
to a real DuckDB store, built by the CLI) is opened in a real headless Chromium at 1,280 × 800, and
the browser itself measures the layout: no element may reach past the viewport's right edge,
with the folded table closed and open. A one-run-a-side report and a `--split-at-flip` report
must still render; the decision `report.json` carries (or, in an older report, the primary row
it falls back to) reads the same in the HTML and the Markdown.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from servescope.reports.forest import INDICATORS, forest_svg
from servescope.reports.judge import is_share
from servescope.reports.render import render
from servescope.store import Store
from tests.helpers.calibration import store_comparison
from tests.helpers.cli import servescope
from tests.helpers.markdown import markdown_text
from tests.helpers.reports import T0, store_run, synthetic_events

WIDTH, HEIGHT = 1280, 800  # a laptop's screen: the decision must be on it
REPEATS = 5
HOSTILE = "<img src=x onerror=alert(1)>"
LONG_ID = "run-glance-" + "flip" * 30  # one unbreakable word wider than the page's column

# In the browser: everything wider than the viewport, as "tag.class (right edge)".
OVERFLOW = """(() => {
  const width = window.innerWidth, wide = [];
  for (const e of document.querySelectorAll('body *')) {
    const box = e.getBoundingClientRect();
    if (box.right > width + 1) {
      const cls = (e.getAttribute('class') || '').trim().split(/\\s+/).filter(Boolean);
      wide.push(e.tagName.toLowerCase() + cls.map(c => '.' + c).join('') +
                ' (right ' + Math.round(box.right) + ')');
    }
  }
  return {scrollWidth: document.documentElement.scrollWidth, innerWidth: width, wide: wide};
})()"""
LAYOUT = """(() => {
  const box = s => { const e = document.querySelector(s); if (!e) return null;
                     const r = e.getBoundingClientRect(); return {top: r.top, bottom: r.bottom}; };
  const forest = document.querySelector('svg.forest');
  return {
    forests: document.querySelectorAll('svg.forest').length,
    lines: forest ? [...forest.querySelectorAll('g.line')].map(g => g.dataset.indicator) : [],
    decision: box('.decision'), forest: box('svg.forest'),
    details: [...document.querySelectorAll('details')].map(d => d.open),
    table_folded: !!document.querySelector('details table.diff'),
    h1: document.querySelector('h1').innerText, title: document.title,
  };
})()"""
OPEN_ALL = "document.querySelectorAll('details').forEach(d => d.open = true); 1"


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three real reports from one store: pooled (5 a side), one run a side, split at a flip."""
    folder = tmp_path_factory.mktemp("glance")
    db, out = folder / "s.duckdb", folder / "reports"
    store = Store(db)
    c = store_comparison(store, "glance", seed=41, repeats=REPEATS, ttft_effect=0.75)
    flip = LONG_ID
    slow = synthetic_events(flip, seed=3, ttft_divisor=1, start=T0, n=200)
    fast = synthetic_events(flip, seed=4, ttft_divisor=5, start=T0 + timedelta(seconds=30), n=200)
    for i, event in enumerate(fast):
        event["request_id"] = f"{flip}-{i + 201:06d}"
    store_run(store, flip, slow + fast, levers={"enable_prefix_caching": True})
    store.add_lever_flip(
        "enable_prefix_caching", "false", "true", run_id=flip, ts=T0 + timedelta(seconds=25)
    )
    built = {}
    for name, args in (
        ("pooled", [*c.after, "--vs", *c.before]),
        ("one", [c.after[0], "--vs", c.before[0]]),
        ("split", [flip, "--split-at-flip"]),
    ):
        done = servescope(
            "report", "build", *args, "--store", str(db), "--out", str(out), check=True
        )
        built[name] = Path(done.stdout.split()[0]).parent  # the paths it printed
    return built


async def inspect(devtools: str, url: str) -> dict[str, Any]:
    """Open `url` at WIDTH × HEIGHT over the DevTools protocol and measure it: its layout, then
    its overflow with every `<details>` closed (as it opens) and open."""
    async with aiohttp.ClientSession() as session:
        deadline = time.monotonic() + 30
        while True:  # the DevTools port opens before Chromium has made its first page
            async with session.get(f"{devtools}/json/list") as resp:
                page = next((t for t in await resp.json() if t["type"] == "page"), None)
            if page is not None:
                break
            assert time.monotonic() < deadline, "Chromium made no page"
            await asyncio.sleep(0.1)
        async with session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            ids = iter(range(1, 10_000))

            async def call(method: str, **params: Any) -> dict[str, Any]:
                call_id = next(ids)
                await ws.send_json({"id": call_id, "method": method, "params": params})
                while True:
                    message = await asyncio.wait_for(ws.receive_json(), timeout=60)
                    if message.get("id") == call_id:
                        assert "error" not in message, message
                        return message["result"]

            async def evaluate(expression: str) -> Any:
                result = await call("Runtime.evaluate", expression=expression, returnByValue=True)
                assert "exceptionDetails" not in result, result
                return result["result"]["value"]

            await call("Emulation.setDeviceMetricsOverride", width=WIDTH, height=HEIGHT,
                       deviceScaleFactor=1, mobile=False)  # fmt: skip
            await call("Page.enable")
            await call("Page.navigate", url=url)
            deadline = time.monotonic() + 30
            while await evaluate("document.readyState") != "complete":
                assert time.monotonic() < deadline, "the report did not finish loading"
                await asyncio.sleep(0.1)
            layout = await evaluate(LAYOUT)
            closed = await evaluate(OVERFLOW)
            await evaluate(OPEN_ALL)
            opened = await evaluate(OVERFLOW)
            return {"layout": layout, "closed": closed, "open": opened}


def present(report: dict[str, Any]) -> set[str]:
    """The core indicators the report measured: a row of one of its metrics with a number (a
    share's change is in points: a before of 0 still counts)."""
    return {
        i.name
        for i in INDICATORS
        if any(
            d["metric"] in i.metrics
            and d["delta"] is not None
            and (d["delta_pct"] is not None or is_share(d["metric"]))
            for d in report["diff"]
        )
    }


def assert_fits(seen: dict[str, Any], state: str) -> None:
    assert seen["innerWidth"] == WIDTH, seen
    assert not seen["wide"], f"{state}: wider than {WIDTH} px: {seen['wide'][:12]}"
    assert seen["scrollWidth"] <= seen["innerWidth"], f"{state}: scrolls sideways: {seen}"


def test_a_pooled_report_fits_1280_px_with_the_decision_and_the_forest_on_the_first_screen(
    chromium: str,  # noqa: F811 (the fixture imported above)
    reports: dict[str, Path],
) -> None:
    folder = reports["pooled"]
    report = json.loads((folder / "report.json").read_text())
    seen = asyncio.run(inspect(chromium, (folder / "index.html").as_uri()))
    layout = seen["layout"]

    assert_fits(seen["closed"], "as opened")
    assert_fits(seen["open"], "with the full table unfolded")
    # a run id of 130 characters without a space fits too (a split of one run names it)
    split = asyncio.run(inspect(chromium, (reports["split"] / "index.html").as_uri()))
    assert LONG_ID in split["layout"]["h1"]
    assert_fits(split["closed"], "split, as opened")
    assert_fits(split["open"], "split, with the full table unfolded")

    # the forest plot: one line per core indicator the report measured, none for the others
    assert layout["forests"] == 1, layout
    expected = present(report)
    assert {"TTFT p50", "TPOT p50", "throughput", "error rate"} <= expected  # the data has them
    assert sorted(layout["lines"]) == sorted(expected), layout["lines"]
    # the decision, and the forest below it, on the first screen of a laptop
    assert layout["decision"] is not None and layout["decision"]["bottom"] <= HEIGHT, layout
    assert layout["forest"]["bottom"] <= HEIGHT, layout
    # the full table follows, folded
    assert layout["table_folded"] and layout["details"] == [False] * len(layout["details"])
    # the title names both arms with their repeats, after first
    design = report["repeats"]  # an arm's name, else (a report before arms had names) its run's
    after = design.get("after_arm") or report["after"]["name"]
    before = design.get("before_arm") or report["before"]["name"]
    arms = f"{after} ×{REPEATS} vs {before} ×{REPEATS}"
    assert layout["h1"] == arms and arms in layout["title"], layout
    md = (folder / "report.md").read_text()
    assert md.splitlines()[0] == f"# {arms}", md.splitlines()[0]


def test_one_run_a_side_and_a_split_report_still_render(reports: dict[str, Path]) -> None:
    for name in ("one", "split"):
        folder = reports[name]
        report = json.loads((folder / "report.json").read_text())
        html = (folder / "index.html").read_text()
        assert html.count('<svg class="forest"') == 1, name
        assert html.count('<g class="line"') == len(present(report)), name
        assert "<details" in html and 'class="decision' in html, name
        md = markdown_text((folder / "report.md").read_text())
        assert "Decision:" in md, name
    one = json.loads((reports["one"] / "report.json").read_text())
    h1 = re.search(r"<h1>(.*?)</h1>", (reports["one"] / "index.html").read_text(), re.S)
    assert h1 and one["run_id"] in h1.group(1) and one["base_run_id"] in h1.group(1)  # run ids


def decision(**changes: Any) -> dict[str, Any]:
    """A stopping rule's decision as `experiment run` writes one (reports/document.py)."""
    return {
        "metric": "ttft_ms.p50", "level": "chat · concurrency 4", "verdict": "undecided",
        "before": 200.0, "after": 180.0, "estimate_pct": -10.0, "interval_pct": [-24.0, 7.5],
        "interval": [-48.0, 15.0], "confidence": 0.987, "margin_pct": 10.0, "look": 6,
        "plan": [3, 10], "stopped": "budget", "more_repeats": 4,
        "reason": f"the time budget ran out {HOSTILE}", "words": f"TTFT p50 undecided {HOSTILE}",
        **changes,
    }  # fmt: skip


def test_a_decision_is_what_the_first_screen_says(reports: dict[str, Path]) -> None:
    """A report with `decision` leads with it (its interval, verdict and why the experiment
    stopped), escaped in both formats; one without leads with its primary row."""
    report = json.loads((reports["pooled"] / "report.json").read_text())
    report.pop("decision", None)
    primary = next(d for d in report["diff"] if d["role"] == "primary")
    old = render(report, "html")
    lead = old[: old.index("<details")]
    assert 'class="decision verdict-improved"' in lead and primary["verdict"] == "improved"
    assert "Stored runs" in lead  # no stopping rule ran

    report["decision"] = decision()
    html, md = render(report, "html"), render(report, "md")
    lead = html[: html.index("<details")]
    assert 'class="decision verdict-undecided"' in lead
    assert "TTFT p50 undecided" in lead and "98.7 % interval is a repeated one" in lead
    assert "The time budget ran out" in lead  # why it stopped
    # the forest's TTFT line is the decision's own reading, in its colour
    ttft = re.search(r'<g class="line" data-indicator="TTFT p50".*?</g>', lead, re.S)
    assert ttft and "−10 % (−24 … +8 %)" in ttft.group(0) and "#bf8700" in ttft.group(0)
    assert HOSTILE not in html and "&lt;img src=x onerror=alert(1)&gt;" in html
    text = markdown_text(md)
    assert md.index("Decision:") < md.index("| level |")
    assert f"TTFT p50 undecided {HOSTILE}" in text  # as text, never a tag
    assert "<img" not in md.replace("\\<img", "")

    report["decision"] = decision(verdict="improved", stopped="decided",
                                  reason="stopped: decided after 6 repeats a side")  # fmt: skip
    lead = render(report, "html")
    assert "Stopped: decided after 6 repeats a side." in lead[: lead.index("<details")]


def test_absurd_share_intervals_never_stretch_the_axis() -> None:
    """An error rate near 0 has a Δ % interval of ±millions of percent: the share is drawn in
    points, and an interval past the axis ends in an arrow at its edge."""
    row = {
        "metric": "error_rate", "level": "whole run", "verdict": "unchanged", "delta": 0.002,
        "delta_pct": 400_000.0, "ci95": [-0.01, 0.014], "ci95_pct": [-2e6, 2.8e6],
        "test": {"scale": "as is"}, "role": "secondary", "before": 0.0000005, "after": 0.0020005,
    }  # fmt: skip
    wide = {
        "metric": "ttft_ms.p50", "level": "whole run", "verdict": "too few samples",
        "delta": 900.0, "delta_pct": 900.0, "ci95": [10.0, 9000.0], "ci95_pct": [50.0, 9000.0],
        "test": {"scale": "log"}, "role": "primary", "before": 100.0, "after": 1000.0,
    }  # fmt: skip
    report: dict[str, Any] = {"diff": [row, wide], "primary": {"level": "whole run"}}
    svg = str(forest_svg(copy.deepcopy(report)))
    width = float(re.search(r'viewBox="0 0 ([\d.]+) ', svg).group(1))  # type: ignore[union-attr]
    xs = [float(x) for x in re.findall(r'\bx[12]?="(-?[\d.]+)"', svg)]
    assert xs and max(xs) <= width and min(xs) >= 0
    assert "+0.2 pp (−1.0 … +1.4 pp)" in svg
    assert 'class="arrow"' in svg  # TTFT's interval runs off the right
    assert 'fill="#ffffff"' in svg  # too few samples: a hollow dot
