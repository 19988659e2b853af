"""`report build` on stored runs: shapes, nulls, bad input, HTML safety."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

from markupsafe import escape

from servescope.store import Store
from tests.helpers.cli import servescope
from tests.helpers.lines import SEED_LINE
from tests.helpers.markdown import markdown_html, markdown_text


def test_seed_run_builds_with_nulls_for_what_was_not_measured(tmp_path: Path) -> None:
    src = tmp_path / "seed.events.jsonl"
    src.write_text(SEED_LINE + "\n")
    db = tmp_path / "s.duckdb"
    servescope("store", "import", str(src), "--store", str(db), check=True)
    out = tmp_path / "r"
    printed = servescope(
        "report", "build", "run-20260512", "--store", str(db), "--out", str(out), check=True
    ).stdout.split()
    assert printed == [
        str(out / "run-20260512" / n) for n in ("index.html", "report.md", "report.json")
    ]
    report = json.loads((out / "run-20260512" / "report.json").read_text())
    assert report["run_id"] == "run-20260512"
    assert report["overall"]["ttft_ms"]["p50"] == 820
    assert report["overall"]["tpot_ms"]["p99"] == 34
    assert report["overall"]["e2e_ms"]["p50"] is None
    assert report["overall"]["throughput"]["requests_per_s"] is None
    assert report["overall"]["cache_hit_request_ratio"] == 1.0
    assert report["overall"]["cached_token_ratio"] is None
    assert report["groups"] == [{**report["groups"][0], "workload": None, "concurrency": None}]


def test_servescope_is_the_one_console_script() -> None:
    """`report` stood on PATH beside `servescope report` and shadowed other tools' `report`:
    the project installs `servescope` alone (pyproject, and the installed distribution)."""
    import tomllib
    from importlib.metadata import distribution

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"] == {"servescope": "servescope.cli:main"}
    installed = {e.name for e in distribution("servescope").entry_points}
    assert installed == {"servescope"}


def test_unknown_run_exits_2_naming_known_runs(tmp_path: Path) -> None:
    db = tmp_path / "s.duckdb"
    Store(db).add_events([{"request_id": "run-known-1"}])
    result = servescope("report", "build", "run-nope", "--store", str(db))
    assert result.returncode == 2
    assert "run-nope" in result.stderr and "run-known" in result.stderr


def test_run_without_events_says_so(tmp_path: Path) -> None:
    db = tmp_path / "s.duckdb"
    Store(db).upsert_run("run-empty", model="m")
    out = tmp_path / "r"
    servescope("report", "build", "run-empty", "--store", str(db), "--out", str(out), check=True)
    assert "no events" in (out / "run-empty" / "report.md").read_text()
    report = json.loads((out / "run-empty" / "report.json").read_text())
    assert report["overall"]["requests"] == 0 and report["overall"]["error_rate"] is None


def test_html_is_self_contained_and_escaped(tmp_path: Path) -> None:
    db = tmp_path / "s.duckdb"
    store = Store(db)
    store.add_events(
        [{"request_id": "run-x-1", "model": "<script>alert(1)</script>", "ttft_ms": 5}]
    )
    store.upsert_run("run-x", model="<script>alert(1)</script>", levers={"<b>": "<i>"})
    out = tmp_path / "r"
    servescope("report", "build", "run-x", "--store", str(db), "--out", str(out), check=True)
    html = (out / "run-x" / "index.html").read_text()
    assert "<script>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    markdown = (out / "run-x" / "report.md").read_text()  # viewers render Markdown to HTML
    assert "\\<script>alert(1)\\</script>" in markdown  # escaped as Markdown, not as HTML
    rendered = markdown_html(markdown)
    assert "<script>" not in rendered and "<b>" not in rendered
    assert "<script>alert(1)</script>" in markdown_text(markdown)


# A run id and a flip note a viewer must show as they are: quotes, a table's pipe, a tag,
# Markdown of their own (emphasis, a link, code) and an entity.
HOSTILE = """run-"o'k" | <script>alert(1)</script> *em* [a](javascript:x) `c` &amp; _u_"""


def test_hostile_strings_are_text_in_both_the_markdown_and_the_html(tmp_path: Path) -> None:
    """Markdown is escaped as Markdown (never with HTML entities, which a Markdown file shows as
    they are), HTML as HTML: a hostile run id and flip note land in both as the same text."""
    db = tmp_path / "s.duckdb"
    store = Store(db)
    store.add_events([{"request_id": "r-1", "run_id": HOSTILE, "ttft_ms": 5}])
    store.add_lever_flip("max_num_seqs", "2", "16", run_id=HOSTILE, note=HOSTILE)
    out = tmp_path / "r"
    servescope("report", "build", HOSTILE, "--store", str(db), "--out", str(out), check=True)
    (folder,) = out.iterdir()
    markdown = (folder / "report.md").read_text()
    entity = r"(?<!\\)&(#[0-9]+|#x[0-9a-f]+|[a-z]+);"  # an HTML entity, not escaped as text
    assert not re.search(entity, markdown, re.I)
    rendered = markdown_html(markdown)
    assert "<script" not in rendered and "<a " not in rendered and "<em>" not in rendered
    (heading,) = re.findall(r"<h1>(.*?)</h1>", rendered)
    assert html.unescape(heading) == f"Run {HOSTILE}"
    # the flips table keeps its six cells, the note whole in the last
    rows = re.findall(r"<tr>(.*?)</tr>", rendered, re.S)
    (flip,) = [r for r in rows if "max_num_seqs" in r]
    cells = [html.unescape(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", flip, re.S)]
    assert cells[1:] == [HOSTILE, "max_num_seqs", "2", "16", HOSTILE]
    page = (folder / "index.html").read_text()
    assert "<script>alert" not in page
    assert escape(HOSTILE) in page  # quotes, tag and entity as HTML text
