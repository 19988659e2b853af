"""Dashboards as code, checked statically: every PromQL expression parses (promql-parser, Grafana
macros substituted), the lint holds (and catches what it should), the JSON loads with
grafana-foundation-sdk, provisioning YAML is what Grafana expects, and the Prometheus rules pass
`promtool check rules` and `promtool test rules` (the real promtool, Debian `prometheus`)."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml
from grafana_foundation_sdk.cog.encoder import JSONEncoder as SdkEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard as SdkDashboard
from grafanalib.core import Target

from servescope.commands.dashboards import run_build
from servescope.dashboards import (
    DATASOURCE_UID,
    provisioning,
)
from servescope.dashboards import panels as kit
from servescope.dashboards.lint import annotation_queries, lint, panels, parse, queries, substitute
from servescope.dashboards.panels import LEVER_FLIP_TAG
from tests.helpers.dashboards import BUILT, RULE_FILES

ALL_QUERIES = [q for dash in BUILT.values() for q in [*queries(dash), *annotation_queries(dash)]]


@pytest.mark.parametrize("query", ALL_QUERIES, ids=lambda q: f"{q.panel}:{q.ref}")
def test_every_expression_parses_after_macro_substitution(query: Any) -> None:
    expr = substitute(query.expr)
    assert "$" not in expr, expr
    promql_parser.parse(expr)  # raises ValueError naming the position


@pytest.mark.parametrize("uid", BUILT)
def test_lint_is_clean(uid: str) -> None:
    assert lint(BUILT[uid]) == []


def test_lint_catches_each_rule_it_states() -> None:
    bad = copy.deepcopy(BUILT["servescope-vllm"])
    first, second, third = list(panels(bad))[:3]
    first["description"] = ""
    first["fieldConfig"]["defaults"]["unit"] = "tokens per fortnight"
    second["targets"][0]["expr"] = "sum(vllm:generation_tokens_total)"
    third["targets"][0]["expr"] = "sum(rate(vllm:prompt_tokens_total[5m]))"
    third["targets"][1]["expr"] = "sum(rate(vllm:prompt_tokens_total[$__rate_interval])"
    third["targets"][1]["datasource"] = {"type": "prometheus", "uid": "some-other-uid"}
    bad["templating"]["list"].append({"name": "ds2", "type": "datasource"})
    problems = "\n".join(lint(bad))
    assert f"{first['title']!r}: no description" in problems
    assert "unit 'tokens per fortnight' is not a Grafana unit" in problems
    assert "counter vllm:generation_tokens_total outside rate()/increase()" in problems
    assert "range [0:05:00] is not [$__rate_interval]" in problems
    assert f"{third['title']!r} / B: does not parse" in problems
    assert f"{third['title']!r}: datasource is not the $datasource variable" in problems
    assert "exactly one datasource variable" in problems


def test_every_panel_has_title_description_unit_and_rate_interval() -> None:
    for dash in BUILT.values():
        for panel in panels(dash):
            assert panel["title"] and panel["description"], panel
            assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]
        for query in queries(dash):
            if "rate(" in query.expr or "increase(" in query.expr:
                assert "[$__rate_interval]" in query.expr, query


def test_vllm_dashboard_puts_the_five_core_indicators_first() -> None:
    titles = [p["title"] for p in panels(BUILT["servescope-vllm"])]
    core = ["TTFT", "TPOT", "Queue time", "Queue depth", "Prefix-cache hit ratio", "Error rate"]
    assert [t for t in titles[: len(core)]] == [
        next(t for t in titles if t.startswith(c)) for c in core
    ]
    exprs = " ".join(q.expr for q in queries(BUILT["servescope-vllm"]))
    for metric in (
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "vllm:num_preemptions_total",
        "vllm:kv_cache_usage_perc",
        "admission_rejected_total",
        "vllm:request_prompt_tokens_bucket",
        "vllm:request_generation_tokens_bucket",
    ):
        assert metric in exprs
    assert "cache_hit_tokens_total" not in exprs  # the seed's name; vLLM does not export it


def test_variables_datasource_and_multi_model() -> None:
    variables = {v["name"]: v for v in BUILT["servescope-vllm"]["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["datasource"]["current"]["value"] == DATASOURCE_UID
    assert variables["model_name"]["multi"] and variables["model_name"]["includeAll"]
    assert variables["model_name"]["allValue"] == ".*"
    team = {v["name"]: v for v in BUILT["servescope-admission"]["templating"]["list"]}["team"]
    assert team["multi"]


def test_lever_flip_annotations_on_every_dashboard() -> None:
    for dash in BUILT.values():
        annotations = dash["annotations"]["list"]
        exprs = [a.get("expr", "") for a in annotations]
        assert any("servescope_lever_flip_info" in e for e in exprs), dash["title"]
        tagged = [a for a in annotations if a.get("target", {}).get("type") == "tags"]
        assert tagged and tagged[0]["target"]["tags"] == [LEVER_FLIP_TAG]
        assert all(a["enable"] and "filter" not in a for a in annotations)  # on every panel


@pytest.mark.parametrize("uid", BUILT)
def test_json_loads_with_grafana_foundation_sdk(uid: str) -> None:
    dash = BUILT[uid]
    model = SdkDashboard.from_json(dash)
    assert model.uid == uid and model.title == dash["title"]
    assert [p.title for p in model.panels] == [p["title"] for p in dash["panels"]]
    # a round trip through the SDK's typed model keeps every query, description and unit
    again = json.loads(json.dumps(model, cls=SdkEncoder))
    assert [(q.ref, q.expr) for q in queries(again)] == [(q.ref, q.expr) for q in queries(dash)]
    assert [p.get("description") for p in panels(again)] == [
        p.get("description") for p in panels(dash)
    ]
    assert [p["fieldConfig"]["defaults"]["unit"] for p in panels(again)] == [
        p["fieldConfig"]["defaults"]["unit"] for p in panels(dash)
    ]


def test_every_rule_expression_parses() -> None:
    rules = [
        r for f in RULE_FILES for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"]
    ]
    assert {r.get("alert") for r in rules} >= {
        "VllmTtftP95OverSlo",
        "VllmErrorRateHigh",
        "VllmPrefixCacheHitRatioCollapse",
        "VllmWaitingQueueGrowing",
        "VllmKvCacheAlmostFull",
        "VllmPreemptions",
        "AdmissionRejectionRatioHigh",
    }
    for rule in rules:
        parse(rule["expr"])


def test_build_refuses_a_dashboard_that_fails_the_lint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def raw_counter() -> Any:
        panel = kit.timeseries("Raw counter", "", "s", [kit.Query("vllm:prompt_tokens_total", "")])
        panel.targets.append(Target(expr="up", refId="B"))  # no datasource
        return kit.dashboard("broken", "Broken", "a dashboard that must not ship", [panel])

    monkeypatch.setitem(provisioning.DASHBOARDS, "broken", raw_counter)
    out = tmp_path / "out"
    args = argparse.Namespace(
        out=out, prometheus_url="http://p:9090", scrape_interval="5s", json=False
    )
    assert run_build(args) == 1
    assert not out.exists()  # nothing written, not even the good dashboards
