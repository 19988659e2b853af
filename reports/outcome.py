"""An experiment's outcome on a terminal (rich): the runs' indicators, one line per run where
the console is wide enough, else one column per run; and per pooled comparison its verdicts,
row by row from the pooled report (reports/experiment.py computes every figure)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from servescope.reports.experiment import (
    POOLED_METRICS,
    Built,
    Shown,
    primary_level,
    shown_indicators,
    verdict_rows,
)
from servescope.reports.verdict import signed_change

Row = Mapping[str, object]  # an OutcomeRow, or a VerdictRow, read by its indicators' keys

NOTES = {
    "server_prefix_cache_hit_ratio": "server hit ratio: Δhits/Δqueries",
    "client_cached_token_ratio": "client cached ratio: cached_tokens/prompt_tokens",
    "spec_decode_acceptance_rate": "draft acceptance: accepted/draft tokens",
}


def _note(rows: Sequence[Row], indicators: list[Shown]) -> str:
    """What the figures are: whose TTFT (the client's, or vLLM's where the client had none),
    and how the ratios shown are computed."""
    sources = sorted({str(r["ttft_source"]) for r in rows if r.get("ttft_source")})
    parts = [f"TTFT: {' and '.join(sources)} side"] if sources else []
    parts += [NOTES[key] for _h, key, _f in indicators if key in NOTES]
    return "; ".join(parts)


def outcome_table(
    rows: Sequence[Row], console: Console, indicators: list[Shown] | None = None
) -> RenderableType:
    """The runs' indicators: one line per run where the console is wide enough for every
    indicator side by side, else one column per run (as many runs a table as fit), so that a
    pipe or an 80-column terminal shows every heading and figure whole."""
    indicators = shown_indicators(rows) if indicators is None else indicators
    note = _note(rows, indicators)
    wide = _runs_by_row(rows, indicators, note)
    unbounded = console.options.update_width(1 << 16)
    if console.measure(wide, options=unbounded).maximum <= console.width:
        return wide
    labels = run_labels(rows)
    heading = max(len(h) for h, _k, _f in indicators)
    per_run = max([len(label) for label in labels] + [len("100.0%")]) + 3  # cell + borders
    fit = max(1, (console.width - heading - 4) // per_run)
    tables: list[RenderableType] = [
        _runs_by_column(rows[i : i + fit], labels[i : i + fit], indicators)
        for i in range(0, len(rows), fit)
    ]
    return Group(*tables, Text(note, style="dim"))


def _cell(row: Row, key: str, spec: str) -> str:
    value = row.get(key)
    return "n/a" if value is None else format(value, spec)


def _runs_by_row(rows: Sequence[Row], indicators: list[Shown], note: str) -> Table:
    table = Table("run", *(h for h, _k, _f in indicators), title=f"runs ({note})")
    for row, label in zip(rows, run_labels(rows), strict=True):
        table.add_row(label, *(_cell(row, k, f) for _h, k, f in indicators))
    return table


def _runs_by_column(rows: Sequence[Row], labels: list[str], indicators: list[Shown]) -> Table:
    table = Table("run", *labels, title="runs")
    for column in table.columns[1:]:
        column.justify = "right"
    for heading, key, spec in indicators:
        table.add_row(heading, *(_cell(row, key, spec) for row in rows))
    return table


def run_labels(rows: Sequence[Row]) -> list[str]:
    """Each run's arm, with its repeat when an arm ran more than once."""
    arms = [str(r.get("arm") or r["profile"]) for r in rows]
    repeated = len(set(arms)) < len(rows)
    return [f"{a} r{r['repeat']}" if repeated else a for a, r in zip(arms, rows, strict=True)]


def _change(delta_pct: float | None, ci: list[float] | None) -> str:
    """Δ % with the interval its verdict reads, e.g. "−81 % (−83…−78)"."""
    if delta_pct is None:
        return "n/a"
    interval = f" ({signed_change(ci[0])}…{signed_change(ci[1])})" if ci else ""
    return f"{signed_change(delta_pct)} %{interval}"


def verdict_table(built: Built, indicators: list[Shown]) -> Table:
    """One pooled comparison at its primary level: before and after (the repeats pooled),
    Δ % with the interval its verdict reads (the primary's: the stopping rule's; the others':
    their correction's) and the verdict, row by row from the pooled report."""
    repeats = built.report.get("repeats")
    k_before = repeats["before"] if repeats else len(built.before)
    k_after = repeats["after"] if repeats else len(built.after)
    table = Table(
        "indicator",
        "before",
        "after",
        "Δ (interval)",
        "verdict",
        title=f"{built.label} at {primary_level(built.report)}: {k_before} vs {k_after} "
        "runs pooled (* the primary indicator)",
    )
    for column in table.columns[1:4]:
        column.justify = "right"
    specs = {key: (heading, spec) for heading, key, spec in indicators}
    for row in verdict_rows(built.report, [k for k in POOLED_METRICS if k in specs]):
        heading, spec = specs[row["key"]]
        table.add_row(
            heading + (" *" if row.get("role") == "primary" else ""),
            _cell(row, "before", spec),
            _cell(row, "after", spec),
            _change(row["delta_pct"], row["ci95_pct"]),
            str(row.get("verdict") or ""),
        )
    return table
