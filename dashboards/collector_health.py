"""The Collector health dashboard: is the sidecar keeping up, and is anything going to
`ingest_errors`? Lines read, events written, ingest errors by reason, lag, last flush age."""

from __future__ import annotations

from grafanalib.core import Dashboard

from servescope.dashboards.panels import RATE, Query, dashboard, row, timeseries

UID = "servescope-collector"


def build() -> Dashboard:
    panels = [
        row("Collector sidecar"),
        timeseries(
            "Lines read per second by source",
            "Log and events-file lines the collector read. Bad: zero for a source that should "
            "be producing (a rotated file not followed, a wrong path) while vLLM serves.",
            "cps",
            [
                Query(
                    f"sum by (source) (rate(servescope_collector_lines_total[{RATE}]))",
                    "{{source}}",
                )
            ],
        ),
        timeseries(
            "Events written per second",
            "Request events committed to the store. Bad: below the request rate the server "
            "reports - requests are being lost or are stuck unjoined.",
            "cps",
            [Query(f"sum(rate(servescope_collector_events_written_total[{RATE}]))", "events")],
        ),
        timeseries(
            "Ingest errors per second by reason",
            "Bad input kept in ingest_errors (truncated JSON, garbage, wrong types). Bad: any "
            "steady rate - a producer writes a format the collector does not read.",
            "cps",
            [
                Query(
                    f"sum by (reason) (rate(servescope_collector_ingest_errors_total[{RATE}]))",
                    "{{reason}}",
                )
            ],
        ),
        timeseries(
            "Ingest lag",
            "Time from a line being written to it being committed. Bad: above a few seconds "
            "and rising - the collector cannot keep up; reports and dashboards run behind.",
            "s",
            [Query("max(servescope_collector_lag_seconds)", "lag")],
        ),
        timeseries(
            "Last flush age",
            "Seconds since the collector last committed to the store. Bad: growing without "
            "bound - the collector is stuck or the store is locked.",
            "s",
            [
                Query(
                    "time() - max(servescope_collector_last_flush_timestamp_seconds)",
                    "since last flush",
                )
            ],
        ),
    ]
    return dashboard(
        UID,
        "Collector health",
        "The servescope collector sidecar: lines read, events written, ingest errors, lag and "
        "last flush age.",
        panels,
    )
