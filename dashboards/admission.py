"""The Admission dashboard: what the servescope gateway decided per team - admitted vs rejected
by reason, queue depth and wait, TTFT/TPOT as the team saw them, token budget used.

A rejection is a boundary-protection event, not a failure: these panels show whether one team's
flood stayed inside its own boundary (its rejections rise, other teams' wait and TTFT do not).
"""

from __future__ import annotations

from grafanalib.core import Dashboard

from servescope.dashboards.panels import (
    RATE,
    Query,
    dashboard,
    label_variable,
    quantile,
    row,
    timeseries,
)

UID = "servescope-admission"
TEAM = 'team=~"$team"'


def _rate(metric: str, by: str) -> str:
    return f"sum by ({by}) (rate({metric}{{{TEAM}}}[{RATE}]))"


def build() -> Dashboard:
    """The admission dashboard. A declarative table of panels (a list of definitions, no
    logic), long by nature, as the house rules allow."""
    panels = [
        row("Admission decisions per team"),
        timeseries(
            "Requests by team and outcome",
            "Requests finished per second at the gateway by outcome (ok, error, timeout, "
            "rejected). Bad: error or timeout for a team that stays within its limits - its "
            "isolation is broken or the upstream is failing.",
            "reqps",
            [
                Query(
                    _rate("servescope_gateway_requests_total", "team, outcome"),
                    "{{team}} {{outcome}}",
                )
            ],
            stacked=True,
        ),
        timeseries(
            "Rejections by team and reason",
            "admission.rejected per second by reason: queue_full and token_budget (the team's "
            "own limits, 429), prompt_too_long (413), queue_timeout and upstream_unavailable "
            "(server side, 503). Bad: server-side reasons, or rejections of a team that is "
            "within its limits.",
            "reqps",
            [Query(_rate("admission_rejected_total", "team, reason"), "{{team}} {{reason}}")],
            stacked=True,
        ),
        timeseries(
            "Rejection ratio per team",
            "Rejected over all requests of the team. Bad: a high ratio for a team that should "
            "fit its limits, or rising ratios for every team at once (capacity, not policy).",
            "percentunit",
            [
                Query(
                    f"{_rate('admission_rejected_total', 'team')} / "
                    f"{_rate('servescope_gateway_requests_total', 'team')}",
                    "{{team}}",
                )
            ],
            max_value=1,
        ),
        timeseries(
            "Admission queue depth per team",
            "Requests waiting for admission. Bad: a queue that stays at max_queue means the "
            "team is over its concurrency; another team's queue growing with it means "
            "isolation failed.",
            "short",
            [Query(f"sum by (team) (servescope_gateway_queue_depth{{{TEAM}}})", "{{team}}")],
        ),
        row("What each team experienced"),
        timeseries(
            "Queue wait p95 per team",
            "Admission wait of admitted requests. Bad: a well-behaved team's wait rising while "
            "another team floods - fairness between teams is not holding.",
            "s",
            [
                Query(
                    quantile(0.95, "servescope_gateway_queue_wait_seconds_bucket", "team", TEAM),
                    "{{team}}",
                )
            ],
        ),
        timeseries(
            "TTFT p95 per team (at the gateway)",
            "Time to first token measured at the gateway, admission wait included. Bad: over "
            "the team's SLO; compare with queue wait to see whether admission or the server "
            "is the cause.",
            "s",
            [
                Query(
                    quantile(0.95, "servescope_gateway_ttft_seconds_bucket", "team", TEAM),
                    "{{team}}",
                )
            ],
        ),
        timeseries(
            "TPOT p95 per team (at the gateway)",
            "Time per output token after the first, measured at the gateway. Bad: rising for "
            "every team at once means the server batches too many sequences.",
            "s",
            [
                Query(
                    quantile(0.95, "servescope_gateway_tpot_seconds_bucket", "team", TEAM),
                    "{{team}}",
                )
            ],
        ),
        timeseries(
            "Token budget used per team",
            "Share of the team's prompt + completion token budget used in the current window. "
            "Bad: at 100 % the team's requests are rejected with token_budget until the window "
            "resets.",
            "percentunit",
            [
                Query(
                    f"max by (team) (servescope_gateway_token_budget_used_ratio{{{TEAM}}})",
                    "{{team}}",
                )
            ],
            max_value=1,
        ),
        timeseries(
            "In flight per upstream",
            "Requests admitted and running on each upstream vLLM. Bad: pinned at the upstream's "
            "global cap while queues grow - the upstream is the bottleneck.",
            "short",
            [Query("sum by (upstream) (servescope_gateway_inflight)", "{{upstream}}")],
        ),
        row("Routing across replicas"),
        timeseries(
            "Routing decisions by replica and reason",
            "Which upstream the gateway chose per second and why (gateway/routing.py: "
            "round-robin, least-outstanding, prefix-home, prefix-spill, prefix-failover, "
            "no-prefix, retry, fallback, only). Bad: retry or prefix-failover rising - a replica "
            "is failing; prefix-spill a large share of prefix-affinity - a hot prefix meets the "
            "load bound (more replicas, or a higher load_factor if its home has room).",
            "reqps",
            [
                Query(
                    f"sum by (upstream, reason) "
                    f"(rate(servescope_gateway_route_decisions_total[{RATE}]))",
                    "{{upstream}} {{reason}}",
                )
            ],
            stacked=True,
        ),
        timeseries(
            "Upstreams up",
            "1 while the gateway sends to an upstream, 0 while it skips it (a refused connection, "
            "a dropped stream or a failed /health probe). Bad: a replica at 0 - the others carry "
            "its load; it comes back by itself when its /health answers.",
            "short",
            [Query("min by (upstream) (servescope_gateway_upstream_up)", "{{upstream}}")],
            max_value=1,
        ),
    ]
    return dashboard(
        UID,
        "Admission",
        "The servescope gateway's admission decisions per team: admitted vs rejected by reason, "
        "queue depth and wait, TTFT and TPOT at the gateway, token budget used, and its routing "
        "decisions across the replicas of a pool.",
        panels,
        [label_variable("team", "servescope_gateway_requests_total", "Team")],
    )
