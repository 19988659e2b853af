"""The speculative-decoding experiment end to end on real vLLMs: the predictable tiny model
served with n-gram speculation off and on (the session's two servers of that model), the seeded
`repeat` and `decoy` workloads against each, acceptance from the runs' scraped /metrics in the
reports, and the TPOT verdict of the diff."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from servescope.store import Store
from tests.helpers.cli import servescope
from tests.helpers.vllm import RunningServer

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def experiment(
    predictable_vllm_server: RunningServer,
    spec_vllm_server: RunningServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict:
    folder = tmp_path_factory.mktemp("spec-experiment")
    result = servescope(
        "experiment",
        "run",
        "speculative-decoding",
        "--target",
        f"default={predictable_vllm_server.url}",
        "--target",
        f"ngram-speculation={spec_vllm_server.url}",
        "--repeats",
        "1",  # the session's servers are shared: one run an arm (they start warm, not reset)
        "--requests",
        "8",
        "--store",
        str(folder / "s.duckdb"),
        "--out",
        str(folder / "reports"),
        "--json",
        timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(result.stdout)
    (page,) = [Path(p) for p in out["reports"]]
    return {
        "out": out,
        "store": Store(folder / "s.duckdb"),
        "report": json.loads((page.parent / "report.json").read_text()),
        "markdown": (page.parent / "report.md").read_text(),
    }


def test_runs_carry_the_speculation_lever(experiment: dict) -> None:
    off, on = experiment["out"]["runs"]
    store: Store = experiment["store"]
    assert (off["profile"], on["profile"]) == ("default", "ngram-speculation")
    for run in (off, on):  # the session's servers run without dev mode: the runs say so
        notes = store.run(run["run_id"])["notes"]
        assert notes["repeat_state"] == "warm: not reset (a --target server without dev mode)"
        assert notes["repeat_design"].startswith("operator's servers")
    assert "speculative_config" not in store.run(off["run_id"])["levers"]
    config = json.loads(store.run(on["run_id"])["levers"]["speculative_config"])
    assert config["method"] == "ngram" and config["num_speculative_tokens"] == 3
    assert off["spec_decode_acceptance_rate"] is None  # no drafts without speculation
    assert on["spec_decode_acceptance_rate"] > 0


def test_drafts_accepted_on_repeat_rejected_on_decoy(experiment: dict) -> None:
    report = experiment["report"]
    assert report["before"]["server"]["spec_decode"] is None  # off: no spec_decode counters
    spec = report["after"]["server"]["spec_decode"]
    by = {w["workload"]: w for w in spec["workloads"]}
    assert set(by) == {"repeat", "decoy"}
    repeat, decoy = by["repeat"], by["decoy"]
    assert repeat["drafts"] > 0 and repeat["acceptance_rate"] > 0.5
    assert decoy["drafts"] > 0  # drafts are proposed there too ...
    assert decoy["acceptance_rate"] < repeat["acceptance_rate"] - 0.3  # ... and rejected
    assert repeat["accepted_per_draft"] > 1.5
    positions = [p["position"] for p in repeat["per_position"]]
    assert positions == [0, 1, 2]
    rates = [p["rate"] for p in repeat["per_position"]]
    assert rates == sorted(rates, reverse=True)  # a draft is accepted up to its first miss
    # the run's total is the two workloads' sum: windows split at level ends, nothing lost
    assert spec["draft_tokens"] == repeat["draft_tokens"] + decoy["draft_tokens"]


def test_diff_puts_tpot_next_to_acceptance(experiment: dict) -> None:
    report = experiment["report"]
    section = report["spec_decode"]
    assert section["on_before"] is False and section["on_after"] is True
    rows = {w["workload"]: w for w in section["workloads"]}
    assert rows["repeat"]["acceptance_before"] is None
    assert rows["repeat"]["acceptance_after"] > 0.5
    at_once = [side["overall"]["one_chunk_streams"]["streams"] for side in
               (report["before"], report["after"])]  # fmt: skip
    # 8 streams a workload: too few only when streams that came all at once (no client TPOT:
    # the decode was not seen) left fewer than 6 TPOTs on a side, not measured when they left none
    unseen = ("too few samples", "not measured")
    for row in rows.values():
        assert row["tpot_verdict"] in ("improved", "regressed", "unchanged", *unseen)
        if row["tpot_verdict"] not in unseen:
            assert row["tpot_ms_p50_before"] is not None and row["tpot_ms_p50_after"] is not None
        else:
            assert max(at_once) > 2, at_once
        if row["tpot_verdict"] == "not measured":
            assert None in (row["tpot_ms_p50_before"], row["tpot_ms_p50_after"]), row
    # TPOT's direction is not asserted: at ~1-2 ms per token on 2 shared cores it is at the
    # mercy of process scheduling (docs/benchmarks.md), down to bursts with TPOT 0; the test is
    # that it is measured on both sides and given a verdict (above)
    (tpot_p50, _) = section["tpot"]
    assert tpot_p50["metric"] == "tpot_ms.p50" and tpot_p50["verdict"] in (
        "improved",
        "regressed",
        "unchanged",
        "undecided",
        *unseen,  # as above: most streams came
    )  # fmt: skip  (all at once; undecided: the primary, by the stopping rule)
    if tpot_p50["verdict"] in unseen:
        assert max(at_once) > 2, at_once
    headline = report["headline"]
    assert headline.startswith("speculative_config off → ngram k=3")
    decision = report["decision"]  # the primary leads: TPOT p50 for a speculation flip, TTFT
    # p50 when TPOT was not measured on both sides (streams that came all at once)
    assert decision["metric"] == report["primary"]["metric"] and decision["words"] in headline
    assert report["primary"]["asked"] == "tpot_ms.p50"
    assert "TPOT p50" in headline
    if tpot_p50["verdict"] not in unseen:  # measured on both sides: its verdict is said
        assert f" {tpot_p50['verdict']}" in headline or f"[{tpot_p50['verdict']}]" in headline
    assert "draft acceptance off → " in headline
    repeat = rows["repeat"]
    assert "repeat: TPOT p50 " in headline
    assert f"[{repeat['tpot_verdict']}] at {repeat['acceptance_after'] * 100:.0f} % acceptance" in (
        headline
    )
    markdown = experiment["markdown"]
    assert "### Speculative decoding: TPOT and ITL next to draft acceptance" in markdown
    assert "### Speculative decoding (from scraped `/metrics`)" in markdown
