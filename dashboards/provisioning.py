"""Writes the dashboards as Grafana JSON plus Grafana's file-provisioning YAML.

Layout of `OUT` (default `servescope-data/dashboards`):

    OUT/servescope-vllm.json, servescope-admission.json, servescope-collector.json
    OUT/provisioning/datasources/servescope.yaml   the Prometheus datasource, uid `prometheus`
    OUT/provisioning/dashboards/servescope.yaml    a file provider reading DASHBOARDS_PATH

Mount `OUT` at `/var/lib/grafana/dashboards/servescope` and `OUT/provisioning` at
`/etc/grafana/provisioning` (Grafana's provider ignores the YAML files under the JSON folder).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from grafanalib._gen import DashboardEncoder
from grafanalib.core import Dashboard

from servescope.dashboards import admission, collector_health, vllm_serving
from servescope.dashboards.lint import lint
from servescope.dashboards.panels import DATASOURCE_UID

DASHBOARDS: dict[str, Callable[[], Dashboard]] = {
    vllm_serving.UID: vllm_serving.build,
    admission.UID: admission.build,
    collector_health.UID: collector_health.build,
}
DASHBOARDS_PATH = "/var/lib/grafana/dashboards/servescope"
RULES_DIR = Path(__file__).parent / "rules"


class LintFailed(ValueError):
    """A dashboard that would mislead its viewers; the message lists every problem."""


@dataclass
class BuildResult:
    dashboards: list[Path] = field(default_factory=list)
    provisioning: list[Path] = field(default_factory=list)
    rules: list[Path] = field(default_factory=list)

    @property
    def paths(self) -> list[Path]:
        return [*self.dashboards, *self.provisioning]


def _without_nulls(value: Any) -> Any:
    """grafanalib writes every unset option as null; Grafana reads a missing key as its default,
    while strict readers (the foundation SDK, the JSON schema) reject the nulls."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def dashboard_json(build_dashboard: Callable[[], Dashboard]) -> dict[str, Any]:
    """The dashboard as Grafana loads it (plain JSON types, no nulls)."""
    text = json.dumps(build_dashboard().to_json_data(), cls=DashboardEncoder)
    return _without_nulls(json.loads(text))


def datasource_yaml(prometheus_url: str, scrape_interval: str) -> dict[str, Any]:
    # timeInterval = the scrape interval, so $__rate_interval always spans >= 4 scrapes.
    return {
        "apiVersion": 1,
        "datasources": [
            {
                "name": "Prometheus",
                "uid": DATASOURCE_UID,
                "type": "prometheus",
                "access": "proxy",
                "url": prometheus_url,
                "isDefault": True,
                "editable": False,
                "jsonData": {"timeInterval": scrape_interval},
            }
        ],
    }


def provider_yaml() -> dict[str, Any]:
    return {
        "apiVersion": 1,
        "providers": [
            {
                "name": "servescope",
                "folder": "servescope",
                "type": "file",
                "disableDeletion": True,
                "allowUiUpdates": False,
                "updateIntervalSeconds": 30,
                "options": {"path": DASHBOARDS_PATH, "foldersFromFilesStructure": False},
            }
        ],
    }


def build(
    out: Path,
    *,
    prometheus_url: str = "http://prometheus:9090",
    scrape_interval: str = "5s",
) -> BuildResult:
    """Build every dashboard, lint it, and write JSON and provisioning YAML under `out`.
    Nothing is written when any dashboard fails the lint (LintFailed lists why)."""
    built = {uid: dashboard_json(make) for uid, make in DASHBOARDS.items()}
    problems = [p for dash in built.values() for p in lint(dash)]
    if problems:
        raise LintFailed("\n".join(problems))
    result = BuildResult(rules=sorted(RULES_DIR.glob("*.yml")))
    out.mkdir(parents=True, exist_ok=True)
    for uid, dash in built.items():
        path = out / f"{uid}.json"
        path.write_text(json.dumps(dash, indent=2, ensure_ascii=False) + "\n")
        result.dashboards.append(path)
    for kind, doc in (
        ("datasources", datasource_yaml(prometheus_url, scrape_interval)),
        ("dashboards", provider_yaml()),
    ):
        path = out / "provisioning" / kind / "servescope.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        result.provisioning.append(path)
    return result
