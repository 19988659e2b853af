"""`servescope dashboards build`: the Grafana dashboards as JSON plus provisioning YAML."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from servescope.commands.common import command_group, console
from servescope.dashboards import RULES_DIR, LintFailed, build
from servescope.store import settings


def register(sub: argparse._SubParsersAction) -> None:
    commands = command_group(
        sub, "dashboards", help="build the Grafana dashboards (JSON + provisioning)"
    )
    cmd = commands.add_parser(
        "build",
        help="write the dashboards' JSON and Grafana provisioning YAML",
        description="Build the vLLM serving, Admission and Collector health dashboards "
        "(grafanalib), lint them (every panel titled, described, with a unit; every PromQL "
        "expression parses; counters only under rate()/increase() over $__rate_interval), and "
        "write OUT/*.json, OUT/provisioning/datasources/servescope.yaml and "
        "OUT/provisioning/dashboards/servescope.yaml. Load them by mounting OUT at "
        "/var/lib/grafana/dashboards/servescope and OUT/provisioning at "
        "/etc/grafana/provisioning, or import a JSON file in Grafana (Dashboards > New > "
        "Import). Prometheus rules are in dashboards/rules/. Exits 1 when the lint fails "
        "(nothing is written then).",
    )
    cmd.add_argument(
        "--out",
        type=Path,
        default=settings.dashboards_dir(),
        help=f"(default: {settings.dashboards_dir()})",
    )
    cmd.add_argument(
        "--prometheus-url",
        default="http://prometheus:9090",
        help="the datasource URL Grafana uses (default: the compose service)",
    )
    cmd.add_argument(
        "--scrape-interval",
        default="5s",
        help="Prometheus' scrape interval, the datasource's timeInterval (default 5s)",
    )
    cmd.add_argument("--json", action="store_true", help="print the written paths as JSON")
    cmd.set_defaults(func=run_build)


def run_build(args: argparse.Namespace) -> int:
    try:
        result = build(
            args.out, prometheus_url=args.prometheus_url, scrape_interval=args.scrape_interval
        )
    except LintFailed as exc:
        console.print(f"dashboards failed the lint, nothing written:\n{exc}", style="red")
        return 1
    if args.json:
        print(
            json.dumps(
                {
                    "dashboards": [str(p) for p in result.dashboards],
                    "provisioning": [str(p) for p in result.provisioning],
                    "rules": [str(p) for p in result.rules],
                }
            )
        )
        return 0
    console.print(
        f"{len(result.dashboards)} dashboards in {args.out.resolve()}; rules in {RULES_DIR}"
    )
    for path in result.paths:
        print(path.resolve())
    return 0
