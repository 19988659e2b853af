"""Reports of a fleet run (reports/replicas.py): the per-replica table, the skew lines, the
per-replica change of a diff and the diagnosis's routing rules — each checked against a plain
computation over the stored events and samples. The same reports over real replicas behind
the gateway are built by tests/e2e/test_fleet_vllm.py and the `routing` experiment."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

from servescope.reports.diagnosis import diagnose
from servescope.store import Store
from tests.helpers.cli import servescope
from tests.helpers.fleet import T0, fleet_run


def test_report_build_writes_the_fleet_sections(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    fleet_run(store, "run-fleet-a", share_r1=20, start=T0, policy="round-robin",
              hits={"r1": (4000.0, 5000.0), "r2": (3000.0, 5000.0)})  # fmt: skip
    fleet_run(store, "run-fleet-b", share_r1=20, start=T0 + timedelta(minutes=5),
              policy="prefix-affinity",
              hits={"r1": (4500.0, 5000.0), "r2": (4000.0, 5000.0)})  # fmt: skip
    out = tmp_path / "reports"
    for args in (["run-fleet-a"], ["run-fleet-b", "--vs", "run-fleet-a"]):
        result = servescope("report", "build", *args, "--store", str(store.path), "--out",
                            str(out), timeout=300)  # fmt: skip
        assert result.returncode == 0, result.stderr
    folder = out / "run-fleet-a"
    data = json.loads((folder / "report.json").read_text())
    assert [r["replica"] for r in data["replicas"]] == ["r1", "r2", None]
    assert set(data["skew"]) >= {"requests", "ttft_ms_p95", "prefix_cache_hit_ratio"}
    md = (folder / "report.md").read_text()
    assert "### By replica" in md and "| `r1` | 20 |" in md and "(reached no replica)" in md
    assert "coefficient of variation" in (folder / "index.html").read_text()
    diff_md = (out / "run-fleet-b-vs-run-fleet-a" / "report.md").read_text()
    assert "### By replica: before → after" in diff_md
    assert diagnose(data)["indicators"]["replicas"]["value"] == 2
