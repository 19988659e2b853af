"""A fleet run's server numbers from the Prometheus that already scrapes its replicas.

In production every replica's `/metrics` is scraped by Prometheus anyway; `report build RUN
--prometheus URL` reads each replica's counters and histograms over the run's window from its
HTTP API instead of the samples servescope scraped itself, one instance per replica (the
`instance` label is the replica URL's `host:port`, Prometheus's default for a static target).
The window is [S, E]: the run's start, and its end plus two scrape intervals of those targets
(from `/api/v1/targets`; 30 s when Prometheus does not say; never later than now), so a scrape
taken after the run's last request is inside it.

- counters grow by `NAME @ E − NAME @ S` (each the last sample at or before that instant; a
  series born inside the window counts from 0): the difference of two samples, as servescope
  computes its own — not `increase()`, whose extrapolation to the range's edges scales the whole
  growth by the range over the sampled span (8 % on a 25 s run scraped every second). A replica
  that restarted inside the window (`resets() > 0`) gets `increase()`, which handles resets;
- gauges: `max_over_time(NAME[E − S] @ E)` — KV-cache usage, running and waiting peaks;
- histograms: `histogram_quantile(0.95, sum by (instance, le) (bucket growth))`, the growth
  taken as for counters — vLLM's queue, TTFT, prefill and decode times.

With no other traffic on the replicas, a counter then equals servescope's own exactly and a
quantile is the same bucket interpolation (reports/histograms.py is Prometheus's algorithm), so
both sit within the histogram's bucket error of the requests' true quantile. Gauges are sampled
at each scraper's own instants: their peaks agree only as well as the samples do.
"""

from __future__ import annotations

import json
import math
import re
import urllib.parse
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from servescope.reports.document import ReplicasServer
from servescope.store.clock import utcnow

UNKNOWN_INTERVAL_PAD_S = 30.0
TIMEOUT_S = 30.0


class PrometheusUnavailable(RuntimeError):
    """Prometheus did not answer a query as it should; the message says which and why."""


def _get(base: str, path: str, params: dict[str, str]) -> Any:
    import urllib.error
    import urllib.request  # only a report that asks Prometheus pays for the HTTP client

    url = f"{base.rstrip('/')}{path}?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # Prometheus says why in its JSON body
        detail = exc.read()[:500].decode(errors="replace")
        raise PrometheusUnavailable(
            f"Prometheus at {base}: {path} answered {exc.code}: {detail}"
        ) from exc
    except (OSError, ValueError) as exc:
        raise PrometheusUnavailable(f"Prometheus at {base}: {path} failed: {exc}") from exc
    if not isinstance(body, dict) or body.get("status") != "success":
        error = body.get("error") if isinstance(body, dict) else body
        raise PrometheusUnavailable(f"Prometheus at {base}: {path} answered {error!r}")
    return body["data"]


def instance_of(url: str) -> str:
    """The `instance` label Prometheus gives a static target at `url`."""
    return urllib.parse.urlsplit(url).netloc


def _seconds(text: str) -> float | None:
    """A Prometheus duration (`1s`, `15s`, `1m30s`, `500ms`) in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text or "")
    if not parts:
        return None
    scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(n) * scale[u] for n, u in parts)


def scrape_pad_s(base: str, instances: list[str]) -> float:
    """Two scrape intervals of the replicas' targets (the slowest), or 30 s when unknown."""
    data = _get(base, "/api/v1/targets", {"state": "active"})
    intervals = [
        s
        for t in data.get("activeTargets", [])
        if (t.get("labels") or {}).get("instance") in instances
        and (s := _seconds(str(t.get("scrapeInterval", "")))) is not None
    ]
    return 2 * max(intervals) if intervals else UNKNOWN_INTERVAL_PAD_S


def _vector(base: str, promql: str, at: datetime) -> dict[str, float | None]:
    """An instant query's result by instance: {instance: value} (NaN: None)."""
    data = _get(base, "/api/v1/query", {"query": promql, "time": f"{at.timestamp():.3f}"})
    out: dict[str, float | None] = {}
    for sample in data.get("result", []):
        labels = sample.get("metric", {})
        value = float(sample["value"][1])
        out[labels.get("instance", "")] = None if math.isnan(value) else value
    return out


def server_side(
    base: str,
    urls: dict[str, str],
    start: datetime,
    end: datetime,
    names: tuple[Sequence[str], Sequence[str], dict[str, str]],
) -> tuple[dict[str, dict[str, float | None]], ReplicasServer]:
    """Per replica URL the numbers `reports.replicas` reads from its own scrapes (the growth
    of `names`' counters, its gauges' peaks, `<key>_p95_s` of its histograms by key), from
    Prometheus; and what was asked (URL, window, instances) for the report. `start`/`end` are
    naive UTC."""
    counters, gauges, histograms = names
    by_instance = {instance_of(url): url for url in urls.values()}
    instances = sorted(by_instance)
    pad = scrape_pad_s(base, instances)
    now = utcnow()
    until = min(end + timedelta(seconds=pad), now)
    at = until.replace(tzinfo=UTC)
    start_s, end_s = start.replace(tzinfo=UTC).timestamp(), at.timestamp()
    window = f"{max(1, math.ceil((until - start).total_seconds()))}s"
    # a regex of the exact instances, inside a PromQL string literal (its backslashes doubled)
    match = "|".join(re.escape(i) for i in instances).replace("\\", "\\\\")
    selector = f'{{instance=~"{match}"}}'
    found: dict[str, dict[str, float | None]] = {url: {} for url in by_instance.values()}

    def fill(key: str, promql: str) -> None:
        for instance, value in _vector(base, promql, at).items():
            if instance in by_instance:
                found[by_instance[instance]][key] = value

    restarted = set(
        k
        for k, v in _vector(
            base,
            f"sum by (instance) (resets(vllm:request_success_total{selector}[{window}]))",
            at,
        ).items()
        if v
    )

    def growth(name: str, by: str) -> str:
        """The growth of NAME's series over [S, E] summed `by`; increase() where restarted."""
        at_s, at_e = f"@ {start_s:.3f}", f"@ {end_s:.3f}"
        plain = (
            f"{name}{selector} {at_e} - ({name}{selector} {at_s} or {name}{selector} {at_e} * 0)"
        )
        if not restarted:
            return f"sum by ({by}) ({plain})"
        again = "|".join(re.escape(i) for i in sorted(restarted)).replace("\\", "\\\\")
        reset = f'increase({name}{{instance=~"{again}"}}[{window}] {at_e})'
        kept = f'({plain}) unless on (instance) {name}{{instance=~"{again}"}} {at_e}'
        return f"sum by ({by}) (({kept}) or {reset})"

    for name in counters:
        fill(name, growth(name, "instance"))
    for name in gauges:
        fill(name, f"max by (instance) (max_over_time({name}{selector}[{window}]))")
    for key, name in histograms.items():
        fill(f"{key}_p95_s", f"histogram_quantile(0.95, {growth(name, 'instance, le')})")
    asked = ReplicasServer(
        source="prometheus",
        url=base,
        instances={name: instance_of(url) for name, url in urls.items()},
        since=start.isoformat() + "Z",
        until=until.isoformat() + "Z",
        range=window,
        evaluated_at=at.isoformat().replace("+00:00", "Z"),
    )
    return found, asked
