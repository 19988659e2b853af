"""servescope's Grafana dashboards as code (grafanalib), their lint, the provisioning files
Grafana loads them with, and the Prometheus recording/alert rules in `rules/`.

    from servescope.dashboards import build
    build(Path("servescope-data/dashboards"))   # JSON + provisioning YAML, lint-checked

Imports nothing of servescope's other rooms.
"""

from servescope.dashboards.provisioning import (
    DASHBOARDS,
    DATASOURCE_UID,
    RULES_DIR,
    BuildResult,
    LintFailed,
    build,
    dashboard_json,
)

__all__ = [
    "DASHBOARDS",
    "DATASOURCE_UID",
    "RULES_DIR",
    "BuildResult",
    "LintFailed",
    "build",
    "dashboard_json",
]
