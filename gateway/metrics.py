"""The gateway's Prometheus metrics, in a registry of its own (served at `/metrics`).

Label values are team, upstream, outcome and reason names from gateway.yaml — never keys.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 30.0, 60.0,
)  # fmt: skip
QUEUE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.5, 1.0, 2.5)


class GatewayMetrics:
    def __init__(self) -> None:
        self._outcomes: dict[tuple[str, str], Any] = {}  # label children, looked up once
        self._per_team: dict[str, tuple[Any, Any, Any]] = {}
        self._routes: dict[tuple[str, str, str], Any] = {}
        self.registry = CollectorRegistry()
        counter = partial(Counter, registry=self.registry)
        gauge = partial(Gauge, registry=self.registry)
        histogram = partial(Histogram, registry=self.registry)
        self.rejected = counter(
            "admission_rejected",
            "Requests the gateway refused (boundary-protection events), by team and reason",
            ["team", "reason"],
        )
        self.requests = counter(
            "servescope_gateway_requests",
            "Requests by team and outcome (the event's status)",
            ["team", "outcome"],
        )
        self.queue_depth = gauge(
            "servescope_gateway_queue_depth", "Requests waiting for admission", ["team"]
        )
        self.queue_wait = histogram(
            "servescope_gateway_queue_wait_seconds",
            "Admission wait of admitted requests",
            ["team"],
            buckets=QUEUE_BUCKETS,
        )
        self.ttft = histogram(
            "servescope_gateway_ttft_seconds",
            "Time to first token measured at the gateway (arrival → first content chunk)",
            ["team"],
            buckets=LATENCY_BUCKETS,
        )
        self.tpot = histogram(
            "servescope_gateway_tpot_seconds",
            "Time per output token after the first, measured at the gateway",
            ["team"],
            buckets=TPOT_BUCKETS,
        )
        self.inflight = gauge(
            "servescope_gateway_inflight",
            "Requests admitted and running, per upstream",
            ["upstream"],
        )
        self.budget_used = gauge(
            "servescope_gateway_token_budget_used_ratio",
            "Share (0-1) of the team's token budget used in the current window",
            ["team"],
        )
        self.route_decisions = counter(
            "servescope_gateway_route_decisions",
            "Routing decisions (one per attempt: a retry or fallback is another), by model, the "
            "upstream chosen and why (gateway/routing.py)",
            ["model", "upstream", "reason"],
        )
        self.upstream_up = gauge(
            "servescope_gateway_upstream_up",
            "1 while the upstream is used, 0 while it is skipped after a refused connection or a "
            "dropped stream",
            ["upstream"],
        )
        self.reloads = counter(
            "servescope_gateway_config_reloads",
            "SIGHUP reloads of gateway.yaml by outcome",
            ["outcome"],
        )

    def route(self, model: str, upstream: str, reason: str) -> None:
        """Count one routing decision."""
        key = (model, upstream, reason)
        if (counter := self._routes.get(key)) is None:
            counter = self._routes[key] = self.route_decisions.labels(*key)
        counter.inc()

    def observe(self, event: dict[str, Any]) -> None:
        """Count one finished request from its event."""
        team = event.get("team") or "unknown"
        status = event.get("status", "error")
        if (counter := self._outcomes.get((team, status))) is None:
            counter = self._outcomes[(team, status)] = self.requests.labels(team, status)
        counter.inc()
        if status == "rejected":
            self.rejected.labels(team, event["error"].removeprefix("rejected:")).inc()
            return
        if (histograms := self._per_team.get(team)) is None:
            histograms = self._per_team[team] = (
                self.queue_wait.labels(team),
                self.ttft.labels(team),
                self.tpot.labels(team),
            )
        for histogram, key in zip(histograms, ("queue_ms", "ttft_ms", "tpot_ms"), strict=True):
            if (value := event.get(key)) is not None:
                histogram.observe(value / 1000.0)
