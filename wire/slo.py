"""Goodput bounds: the per-request latencies vLLM's `--goodput` accepts, in milliseconds, and
the `ttft_ms=500,tpot_ms=50` text every command takes them as. One place, because the load
generator counts good requests as it runs, the reports count them again from the store, and
both must read `--slo` alike."""

from __future__ import annotations

SLO_METRICS = ("ttft_ms", "tpot_ms", "e2e_ms")


class BadSlo(ValueError):
    """`--slo` text that names an unknown metric or gives no number."""


def parse_slo(text: str | None) -> dict[str, float]:
    """`ttft_ms=500,tpot_ms=50` → {"ttft_ms": 500.0, "tpot_ms": 50.0}; empty or None → {}."""
    slo: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in SLO_METRICS:
            raise BadSlo(f"unknown SLO metric {name!r}; use {', '.join(SLO_METRICS)}")
        try:
            slo[name] = float(value)
        except ValueError:
            raise BadSlo(f"SLO {name} needs a number of milliseconds, got {value!r}") from None
    return slo
