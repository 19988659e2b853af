"""OTLP export: the SDK's real exporters send stored requests to an OTLP endpoint started here;
the decoded protobuf carries the GenAI names and the stored values. With the endpoint down,
`submit` still returns at once and the drop counter rises."""

from __future__ import annotations

import json
from pathlib import Path

from servescope.store import Store
from tests.conftest import servescope
from tests.otlp_sink import otlp_http_sink
from tests.unit.test_otlp_export import RECORDS, RUN, TRACE, closed_port


def test_collect_otlp_export_forwards_each_stored_request_once(tmp_path: Path) -> None:
    """`servescope collect --otlp-export URL`: the requests the collector stores reach the
    endpoint as one span each (runtime lines of the same file are stored, not exported)."""
    events = tmp_path / "client.events.jsonl"
    lines = [*RECORDS, {"type": "tool_call", "run_id": RUN, "tool": "pytest"}]
    events.write_text("".join(json.dumps(r) + "\n" for r in lines))
    db = tmp_path / "s.duckdb"
    with otlp_http_sink() as sink:
        result = servescope(
            "collect", "--once", "--events", str(events), "--otlp-export", sink.url,
            "--store", str(db), "--json",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        sink.wait_for(lambda s: len(s.spans) == 2)
    by_id = {s["attributes"]["servescope.request_id"]: s for s in sink.spans}
    assert set(by_id) == {f"{RUN}-000001", f"{RUN}-000002"}
    assert by_id[f"{RUN}-000001"]["trace_id"] == TRACE
    assert by_id[f"{RUN}-000001"]["attributes"]["gen_ai.usage.input_tokens"] == 1842
    assert Store(db).runtime_events(RUN)[0]["event"]["tool"] == "pytest"


def test_collect_with_an_unreachable_endpoint_still_stores_everything(tmp_path: Path) -> None:
    events = tmp_path / "client.events.jsonl"
    events.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    db = tmp_path / "s.duckdb"
    result = servescope(
        "collect", "--once", "--events", str(events), "--otlp-export",
        f"http://127.0.0.1:{closed_port()}", "--store", str(db), "--json",
        env={"OTEL_EXPORTER_OTLP_TIMEOUT": "1"}, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1])["events"] == 2
    assert {e["request_id"] for e in Store(db).export_events(RUN)} == {
        f"{RUN}-000001",
        f"{RUN}-000002",
    }
