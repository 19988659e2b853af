"""The prefix-caching experiment end to end: two real vLLM servers (caching off and on) up at
once, each with its own collector sidecar, the same seeded Ralph-loop workload against each in
two interleaved repeats (A B B A), each run starting from an emptied prefix cache; runs stored
with levers and notes, lever flips, the pooled report and one per repeat."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

from servescope.loadgen.experiment import KEPT_UP
from servescope.loadgen.servers import STATE_RESET
from servescope.reports.experiment import OUTCOME_INDICATORS
from servescope.store import Store, settings
from tests.helpers.cli import servescope
from tests.helpers.experiments import whole


@pytest.fixture(scope="module")
def experiment(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("experiment")
    store = folder / "s.duckdb"
    result = servescope(
        "experiment",
        "run",
        "prefix-caching",
        "--model",
        str(tiny_model),
        "--repeats",
        "2",
        "--requests",
        "4",
        # A TTFT target no answered request can miss (the bench's request timeout): on a slow
        # machine the latency rules that come before the prefix-cache rule (queue-bound: TTFT
        # p95 over the 1 s default target, half of it queued) would fire on timing alone.
        "--slo",
        "ttft_ms=600000",
        "--store",
        str(store),
        "--out",
        str(folder / "reports"),
        "--json",
        timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return {"out": json.loads(result.stdout), "store": Store(store), "stderr": result.stderr}


def _sides(experiment: dict) -> tuple[list[dict], list[dict]]:
    """The runs of each arm (off, on), in run order."""
    runs = experiment["out"]["runs"]
    return (
        [r for r in runs if r["profile"] == "no-prefix-caching"],
        [r for r in runs if r["profile"] == "default"],
    )


def test_four_runs_interleaved_with_the_profiles_levers(experiment: dict) -> None:
    out, store = experiment["out"], experiment["store"]
    assert out["status"] == "complete" and out["order"] == "A B B A"
    assert out["design"] == KEPT_UP
    assert [(r["profile"], r["repeat"]) for r in out["runs"]] == [
        ("no-prefix-caching", 1), ("default", 1), ("default", 2), ("no-prefix-caching", 2)
    ]  # fmt: skip
    offs, ons = _sides(experiment)
    for row in offs:
        assert store.run(row["run_id"])["levers"]["enable_prefix_caching"] is False
    for row in ons:
        assert store.run(row["run_id"])["levers"]["enable_prefix_caching"] is True
    for position, row in enumerate(out["runs"], start=1):
        assert row["status"] == "complete" and row["errors"] == 0
        assert row["requests"] == 8  # 4 per level, concurrency 1 and 4
        notes = store.run(row["run_id"])["notes"]
        assert notes["experiment"] == "prefix-caching" and notes["server_ready_s"] > 0
        # each run began with its server's prefix cache emptied (vLLM answered success)
        assert notes["repeat_state"] == STATE_RESET and row["repeat_state"] == STATE_RESET
        assert notes["repeat_design"] == KEPT_UP and notes["position"] == position
        assert notes["server_runs_before"] == row["repeat"] - 1
    for arm in ("no-prefix-caching", "default"):  # one server per arm, reset before each run
        log_path = settings.logs_dir() / f"{out['experiment_id']}-{arm}.log"
        log = log_path.read_text(errors="replace")
        assert log.count("Resetting prefix cache") == 2, arm
        assert log.count("non-default args") == 1, arm  # started once
    stderr = experiment["stderr"]  # the outcome table, printed to a pipe: one column per run
    assert "┃ run " in stderr, stderr[-4000:]
    table = stderr[stderr.index("┃ run ") : stderr.index("cached_tokens/prompt_tokens")]
    whole(
        table,
        [i for i in OUTCOME_INDICATORS if i[0] not in {"probe TTFT p50 ms", "draft acceptance"}],
    )
    assert "probe TTFT" not in table and "draft acceptance" not in table  # nothing to show
    assert "no-prefix-caching r1" in table and "default r2" in table
    # the pooled verdict table and headline follow it
    said = " ".join(stderr.split())  # the console wraps its lines at 80 columns
    assert "no-prefix-caching → default at " in said and "runs pooled" in said
    # two runs a side bound some rows beyond any use: said as "> +1,000 %", never in millions
    assert not re.search(r"\d,\d{3},\d{3}(,\d{3})* (%|tok/s)", said), said


def test_server_side_hit_ratio_and_ttft_move_as_expected(experiment: dict) -> None:
    offs, ons = _sides(experiment)
    for off, on in zip(offs, ons, strict=True):  # the mechanism, in every repeat
        assert off["server_prefix_cache_hit_ratio"] == pytest.approx(0.0, abs=0.01)
        assert on["server_prefix_cache_hit_ratio"] > 0.5
        assert (off["client_cached_token_ratio"] or 0.0) < 0.01
        assert on["client_cached_token_ratio"] > 0.5
        assert off["ttft_source"] == on["ttft_source"] == "client"
    # its effect on TTFT, over both repeats' requests: one run of 8 requests can meet a stall of
    # the machine (another process, another server starting) that the other arm's run did not
    store: Store = experiment["store"]

    def ttfts(runs: list[dict]) -> list[float]:
        events = [e for r in runs for e in store.export_events(r["run_id"])]
        # every record of a bench run is the client's (a server's piece merged into it): one
        # without the client's keys is a piece that missed its request (seen once, busy)
        alone = [e for e in events if "ttft_ms" not in e or "concurrency" not in e]
        assert not alone, f"records without the client's keys: {alone}"
        return [e["ttft_ms"] for e in events]

    assert statistics.median(ttfts(ons)) < statistics.median(ttfts(offs))


def test_every_run_sent_the_same_prompts(experiment: dict) -> None:
    store: Store = experiment["store"]
    first, *others = experiment["out"]["runs"]

    def prompts(run_id: str) -> set[tuple]:
        return {
            (e["concurrency"], e["plan_index"], e["prompt_sha"], e["prompt_tokens"])
            for e in store.export_events(run_id)
        }

    assert all(prompts(first["run_id"]) == prompts(run["run_id"]) for run in others)


def test_each_switch_is_a_lever_flip_and_reports_are_written(experiment: dict) -> None:
    store: Store = experiment["store"]
    out = experiment["out"]
    ids = [r["run_id"] for r in out["runs"]]
    (off1, on1), (off2, on2) = zip(*_sides(experiment), strict=True)
    with store.read() as con:
        flips = con.execute(
            "SELECT lever, before, after, run_id, before_run_id FROM lever_flips "
            "WHERE run_id IN (SELECT unnest($ids)) ORDER BY ts",
            {"ids": ids},
        ).fetchall()
        sessions = con.execute(
            "SELECT run_id FROM runs WHERE label = 'vLLM server session' ORDER BY started_at"
        ).fetchall()
        traced = con.execute(
            "SELECT count(*) FILTER (WHERE server_ttft_ms IS NULL OR vllm_session IS NULL) "
            "FROM events WHERE run_id IN (SELECT unnest($ids))",
            {"ids": ids},
        ).fetchone()
    # the experiment's switches (A B, then B A: none between the two runs of `default`); the
    # sidecars' view: one session per server, each server with its own collector, every
    # request joined with its trace
    assert flips == [
        ("enable_prefix_caching", "False", "True", on1["run_id"], off1["run_id"]),
        ("enable_prefix_caching", "True", "False", off2["run_id"], on2["run_id"]),
    ]
    assert len(sessions) == 2
    assert traced == (0,)
    (report,) = [Path(p) for p in out["reports"]]  # the pooled one
    diff = json.loads((report.parent / "report.json").read_text())
    assert diff["repeats"]["before_runs"] == [off1["run_id"], off2["run_id"]]
    assert diff["repeats"]["after_runs"] == [on1["run_id"], on2["run_id"]]
    assert diff["repeats"]["before"] == diff["repeats"]["after"] == 2
    (verdicts,) = out["verdicts"]
    assert verdicts["report"] == str(report) and verdicts["headline"] == diff["headline"]
    for row in verdicts["rows"]:  # the console's pooled rows are the report's own
        assert row["metric"] in {r["metric"] for r in diff["diff"]}
    by_repeat = [Path(p) for p in out["repeat_reports"]]  # the detail: one report per repeat
    assert [p.parent.name for p in by_repeat] == [
        f"{on1['run_id']}-vs-{off1['run_id']}", f"{on2['run_id']}-vs-{off2['run_id']}"
    ]  # fmt: skip
    one = json.loads((by_repeat[0].parent / "report.json").read_text())
    assert one["base_run_id"] == off1["run_id"] and one["run_id"] == on1["run_id"]
    for side in ("before", "after"):  # the sidecar's traces: vLLM's phases, both TTFT sources
        overall = one[side]["overall"]
        assert overall["sources"]["ttft_ms"] == "client" and overall["server_ttft_ms"]["p50"]
        for phase in ("queue_ms", "prefill_ms", "decode_ms"):
            assert overall[phase]["p50"] is not None and overall[phase]["p95"] is not None
        # the console's row of that run is the report's figure
        run = next(r for r in out["runs"] if r["run_id"] == one[side]["run_id"])
        assert run["ttft_ms_p50"] == overall["ttft_ms"]["p50"]


def test_diagnosis_recommends_prefix_caching_only_for_the_off_run(experiment: dict) -> None:
    """The seeds' first practicum diagnosed: with caching off the Ralph loop's shared prefix is
    recomputed every turn (prefix caching first); with it on that recommendation never comes,
    and the diff says the flip resolved the symptom it targeted."""
    store: Store = experiment["store"]
    off, on = experiment["out"]["runs"][:2]

    def diagnose(run_id: str) -> dict:
        result = servescope("diagnose", run_id, "--json", "--store", str(store.path))
        assert result.returncode == 0, result.stderr[-2000:]
        return json.loads(result.stdout)

    before = diagnose(off["run_id"])
    assert before["first"]["lever"] == "enable_prefix_caching", before["findings"]
    assert before["first"]["symptom"] == "prefill"
    assert before["findings"][0]["experiment"] == "servescope experiment run prefix-caching"
    after = diagnose(on["run_id"])
    offered = {lever["lever"] for f in after["findings"] for lever in f["levers"]}
    assert "enable_prefix_caching" not in offered
    assert after["workload_shape"]["shape"] == before["workload_shape"]["shape"] == "agent"
    (report,) = [Path(p) for p in experiment["out"]["reports"]]  # pooled over both repeats
    diff = json.loads((report.parent / "report.json").read_text())
    (flip,) = diff["diagnosis"]["flip"]
    assert flip["lever"] == "enable_prefix_caching" and flip["verdict"] == "resolved"
    # the pooled report says how each repeat started, and that its verdict counts run drift
    assert diff["repeats"]["before"] == diff["repeats"]["after"] == 2
    assert diff["repeats"]["covers"] == "run-to-run and request noise"
    states = diff["repeat_states"]["before"] + diff["repeat_states"]["after"]
    assert {s["repeat_state"] for s in states} == {"prefix cache reset"}
    assert "prefix cache reset" in (report.parent / "report.md").read_text()
    # vLLM's start-up statement of its KV cache, recorded with the run next to ours
    kv = store.run(on["run_id"])["notes"]["kv_cache"]
    assert kv["vllm"]["kv_cache_tokens"] == kv["servescope"]["kv_tokens"]
    assert kv["vllm"]["max_concurrency"] == kv["servescope"]["max_concurrency"]
