"""The dashboards as built and the rule files, read once for the tests of both tiers."""

from __future__ import annotations

from servescope.dashboards import (
    DASHBOARDS,
    RULES_DIR,
    dashboard_json,
)

BUILT = {uid: dashboard_json(make) for uid, make in DASHBOARDS.items()}


RULE_FILES = sorted(RULES_DIR.glob("*.yml"))


RULE_TESTS = sorted((RULES_DIR / "tests").glob("*.yml"))
