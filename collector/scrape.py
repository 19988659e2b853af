"""Scraping vLLM `/metrics` into `metric_samples`: a target that is down is a sample (`up` = 0),
never a reason to stop; the labels of `vllm:cache_config_info` are the server's cache levers."""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from store.metrics import Sample, parse_exposition

CACHE_CONFIG = "vllm:cache_config_info"
NOT_LEVER_LABELS = frozenset({"model_name", "engine"})


@dataclass
class Scrape:
    """One scrape of one target: its samples (always including `up`), the cache levers it
    showed, and the reason it failed, if it did."""

    samples: list[Sample] = field(default_factory=list)
    cache_levers: dict[str, str] | None = None
    error: str | None = None
    body: str = ""


def scrape(url: str, *, timeout: float = 5.0, ts: datetime | None = None) -> Scrape:
    ts = ts or datetime.now(UTC).replace(tzinfo=None)
    result = Scrape()
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
    for _ts, _target, name, labels, _run, _value in result.samples:
        if name == CACHE_CONFIG:
            result.cache_levers = {
                k: v for k, v in sorted(labels.items()) if k not in NOT_LEVER_LABELS
            }
    return result


def lever_changes(before: dict[str, Any], after: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(lever, before, after) for every lever whose value differs (absent = None)."""
    return [
        (key, before.get(key), after.get(key))
        for key in sorted(set(before) | set(after))
        if before.get(key) != after.get(key)
    ]
