"""Scraping vLLM `/metrics` into `metric_samples`: a target that is down is a sample (`up` = 0),
never a reason to stop. Two series say which server answered: `process_start_time_seconds`
(a new value is a restart) and `vllm:cache_config_info` (its labels, the cache configuration)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime

from servescope.store.clock import utcnow
from servescope.wire.exposition import Sample, parse_exposition

CACHE_CONFIG = "vllm:cache_config_info"
PROCESS_START = "process_start_time_seconds"
NOT_LEVER_LABELS = frozenset({"model_name", "engine"})


@dataclass
class Scrape:
    """One scrape of one target: its samples (always including `up`), the server's cache
    configuration and process start, and the reason it failed, if it did."""

    url: str
    samples: list[Sample] = field(default_factory=list)
    cache_config: dict[str, str] | None = None
    process_start: float | None = None
    error: str | None = None
    body: str = ""


def scrape(url: str, *, timeout: float = 5.0, ts: datetime | None = None) -> Scrape:
    ts = ts or utcnow()
    result = Scrape(url)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            result.body = resp.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        result.error = f"scrape failed: {exc}"
    if result.error is None:
        try:
            result.samples = list(parse_exposition(result.body, target=url, ts=ts))
        except (ValueError, TypeError, IndexError) as exc:
            result.error = f"not Prometheus exposition: {exc}"
            result.samples = []
    up = 0.0 if result.error else 1.0
    result.samples.append((ts, url, "up", {}, None, up))
    for _ts, _target, name, labels, _run, value in result.samples:
        if name == CACHE_CONFIG:
            result.cache_config = {
                k: v for k, v in sorted(labels.items()) if k not in NOT_LEVER_LABELS
            }
        elif name == PROCESS_START:
            result.process_start = value
    return result


def server_version(url: str, timeout: float = 2.0) -> str | None:
    """The version a vLLM behind this `/metrics` URL reports on `/version` (None if it cannot)."""
    base = url.rsplit("/metrics", 1)[0]
    try:
        with urllib.request.urlopen(f"{base}/version", timeout=timeout) as resp:
            version = json.loads(resp.read()).get("version")
    except (urllib.error.URLError, OSError, ValueError, AttributeError):
        return None
    return version if isinstance(version, str) else None
