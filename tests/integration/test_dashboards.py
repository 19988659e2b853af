"""Dashboards as code, checked statically: every PromQL expression parses (promql-parser, Grafana
macros substituted), the lint holds (and catches what it should), the JSON loads with
grafana-foundation-sdk, provisioning YAML is what Grafana expects, and the Prometheus rules pass
`promtool check rules` and `promtool test rules` (the real promtool, Debian `prometheus`)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import yaml

from servescope.dashboards import (
    DASHBOARDS,
    DATASOURCE_UID,
)
from tests.helpers.cli import servescope
from tests.helpers.dashboards import BUILT, RULE_FILES, RULE_TESTS


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool not found: install Debian's `prometheus` package (make system-deps)"
    return path


def test_build_command_writes_json_and_provisioning(tmp_path: Path) -> None:
    out = tmp_path / "dash"
    result = servescope(
        "dashboards", "build", "--out", str(out), "--scrape-interval", "15s", "--json", check=True
    )
    written = json.loads(result.stdout)
    assert sorted(Path(p).name for p in written["dashboards"]) == sorted(
        f"{uid}.json" for uid in DASHBOARDS
    )
    for path in written["dashboards"]:
        assert json.loads(Path(path).read_text()) == BUILT[Path(path).stem]
    datasources = yaml.safe_load((out / "provisioning/datasources/servescope.yaml").read_text())
    (source,) = datasources["datasources"]
    assert source["uid"] == DATASOURCE_UID and source["type"] == "prometheus"
    assert source["jsonData"]["timeInterval"] == "15s"
    providers = yaml.safe_load((out / "provisioning/dashboards/servescope.yaml").read_text())
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards/servescope"
    assert [Path(p) for p in written["rules"]] == RULE_FILES


def test_promtool_check_rules() -> None:
    result = subprocess.run(
        [promtool(), "check", "rules", *map(str, RULE_FILES)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_test_rules() -> None:
    assert RULE_TESTS
    result = subprocess.run(
        [promtool(), "test", "rules", *map(str, RULE_TESTS)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAILED" not in result.stdout
