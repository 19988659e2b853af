"""The prefix-caching experiment end to end: two real vLLM servers (caching off, then on), the
same seeded Ralph-loop workload against each, runs stored with levers, a lever flip, reports."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from servescope.commands.experiment import OUTCOME_INDICATORS, outcome_table, ready_model
from servescope.store import Store
from tests.conftest import servescope


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
        "--requests",
        "8",
        "--store",
        str(store),
        "--out",
        str(folder / "reports"),
        "--json",
        timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return {"out": json.loads(result.stdout), "store": Store(store), "stderr": result.stderr}


def _outcome_row(profile: str, repeat: int, hit: float | None) -> dict:
    return {
        "run_id": f"run-x-{profile}-r{repeat}", "profile": profile, "repeat": repeat,
        "status": "complete", "requests": 16, "errors": 0, "ttft_ms_p50": 301.2,
        "ttft_ms_p95": 812.4, "probe_ttft_ms_p50": None, "tpot_ms_p50": 3.04,
        "server_prefix_cache_hit_ratio": hit, "client_cached_token_ratio": 0.957,
        "preemptions": 0, "spec_decode_acceptance_rate": None, "server_ready_s": 80.1,
    }  # fmt: skip


def _rendered(rows: list[dict], width: int) -> str:
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=False)  # a pipe: no terminal
    console.print(outcome_table(rows, console))
    return out.getvalue()


def _whole(text: str) -> None:
    """Every heading of the outcome table whole, nothing cut short, nothing past 80 columns."""
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= 80, text
    for heading, _key, _spec in OUTCOME_INDICATORS:
        assert heading in text, (heading, text)


@pytest.mark.parametrize("repeats", [1, 3])
def test_the_outcome_table_is_readable_at_80_columns(repeats: int) -> None:
    """Printed to a pipe (80 columns), every heading, run and figure shows whole; a terminal
    wide enough keeps one line per run."""
    profiles = ["max-num-seqs-2", "max-num-seqs-8", "max-num-seqs-32"]
    rows = [_outcome_row(p, r, 0.25) for r in range(1, repeats + 1) for p in profiles]
    text = _rendered(rows, 80)
    _whole(text)
    labels = profiles if repeats == 1 else [f"{p} r{r}" for p in profiles for r in (1, 2, 3)]
    for label in labels:
        assert label in text
    assert text.count("25.0%") == len(rows) and text.count("95.7%") == len(rows)
    wide = _rendered(rows, 200)
    assert [line.count("max-num-seqs") for line in wide.splitlines()].count(1) == len(rows)


def test_two_runs_with_the_profiles_levers(experiment: dict) -> None:
    out, store = experiment["out"], experiment["store"]
    assert out["status"] == "complete"
    off, on = out["runs"]
    assert (off["profile"], on["profile"]) == ("no-prefix-caching", "default")
    assert store.run(off["run_id"])["levers"]["enable_prefix_caching"] is False
    assert store.run(on["run_id"])["levers"]["enable_prefix_caching"] is True
    for row in (off, on):
        assert row["status"] == "complete" and row["errors"] == 0
        assert row["requests"] == 16  # 8 per level, concurrency 1 and 4
        notes = store.run(row["run_id"])["notes"]
        assert notes["experiment"] == "prefix-caching" and notes["server_ready_s"] > 0
    stderr = experiment["stderr"]  # the outcome table, printed to a pipe: one column per run
    assert "┃ run " in stderr, stderr[-4000:]
    table = stderr[stderr.index("┃ run ") : stderr.index("accepted/draft tokens")]
    _whole(table)
    assert "no-prefix-caching" in table and "default" in table


def test_server_side_hit_ratio_and_ttft_move_as_expected(experiment: dict) -> None:
    off, on = experiment["out"]["runs"]
    assert off["server_prefix_cache_hit_ratio"] == pytest.approx(0.0, abs=0.01)
    assert on["server_prefix_cache_hit_ratio"] > 0.5
    assert (off["client_cached_token_ratio"] or 0.0) < 0.01
    assert on["client_cached_token_ratio"] > 0.5
    assert on["ttft_ms_p50"] < off["ttft_ms_p50"]


def test_both_runs_sent_the_same_prompts(experiment: dict) -> None:
    store: Store = experiment["store"]
    off, on = experiment["out"]["runs"]

    def prompts(run_id: str) -> set[tuple]:
        return {
            (e["concurrency"], e["plan_index"], e["prompt_sha"], e["prompt_tokens"])
            for e in store.export_events(run_id)
        }

    assert prompts(off["run_id"]) == prompts(on["run_id"])


def test_the_switch_is_a_lever_flip_and_reports_are_written(experiment: dict) -> None:
    store: Store = experiment["store"]
    off, on = experiment["out"]["runs"]
    with store.read() as con:
        flips = con.execute(
            "SELECT lever, before, after, run_id, before_run_id FROM lever_flips ORDER BY ts"
        ).fetchall()
        sessions = con.execute(
            "SELECT run_id FROM runs WHERE label = 'vLLM server session' ORDER BY started_at"
        ).fetchall()
        traced = con.execute(
            "SELECT count(*) FILTER (WHERE server_ttft_ms IS NULL OR vllm_session IS NULL) "
            "FROM events WHERE run_id IN (?, ?)", [off["run_id"], on["run_id"]]
        ).fetchone()
    # the experiment's switch, and the collector sidecar's view of it: one session per server
    # (one log, one port), the restart one flip between them, every request joined with its trace
    (first, second) = [r[0] for r in sessions]
    assert sorted(flips, key=str) == sorted([
        ("enable_prefix_caching", "False", "True", on["run_id"], None),
        ("enable_prefix_caching", "false", "true", second, first),
    ], key=str)  # fmt: skip
    assert traced == (0,)
    (report,) = [Path(p) for p in experiment["out"]["reports"]]
    assert report.exists() and report.parent.name == f"{on['run_id']}-vs-{off['run_id']}"
    diff = json.loads((report.parent / "report.json").read_text())
    assert diff["base_run_id"] == off["run_id"] and diff["run_id"] == on["run_id"]
    for side in ("before", "after"):  # the sidecar's traces: vLLM's phases, both TTFT sources
        overall = diff[side]["overall"]
        assert overall["sources"]["ttft_ms"] == "client" and overall["server_ttft_ms"]["p50"]
        for phase in ("queue_ms", "prefill_ms", "decode_ms"):
            assert overall[phase]["p50"] is not None and overall[phase]["p95"] is not None


def test_diagnosis_recommends_prefix_caching_only_for_the_off_run(experiment: dict) -> None:
    """The seeds' first practicum diagnosed: with caching off the Ralph loop's shared prefix is
    recomputed every turn (prefix caching first); with it on that recommendation never comes,
    and the diff says the flip resolved the symptom it targeted."""
    store: Store = experiment["store"]
    off, on = experiment["out"]["runs"]

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
    (report,) = [Path(p) for p in experiment["out"]["reports"]]
    diff = json.loads((report.parent / "report.json").read_text())
    (flip,) = diff["diagnosis"]["flip"]
    assert flip["lever"] == "enable_prefix_caching" and flip["verdict"] == "resolved"
    # vLLM's start-up statement of its KV cache, recorded with the run next to ours
    kv = store.run(on["run_id"])["notes"]["kv_cache"]
    assert kv["vllm"]["kv_cache_tokens"] == kv["servescope"]["kv_tokens"]
    assert kv["vllm"]["max_concurrency"] == kv["servescope"]["max_concurrency"]


def test_a_model_folder_the_user_names_is_never_rebuilt(tmp_path: Path) -> None:
    """`experiment run --model DIR` with a dummy-weights config (as a GPU server serves the 8B
    shape with `--load-format dummy`) once had the tiny model written over it."""
    config = Path(__file__).parent / "fixtures" / "gpu" / "kv" / "config-8b.json"
    model = tmp_path / "llama-8b-dummy"
    model.mkdir()
    (model / "config.json").write_bytes(config.read_bytes())
    assert ready_model(model, "random", given=True)
    assert [p.name for p in model.iterdir()] == ["config.json"]
    assert (model / "config.json").read_bytes() == config.read_bytes()
    assert not ready_model(tmp_path / "typo", "random", given=True)
    result = servescope(
        "experiment", "run", "prefix-caching", "--model", str(tmp_path / "typo"),
        "--store", str(tmp_path / "s.duckdb"),
    )  # fmt: skip
    assert result.returncode == 2 and "no model folder" in result.stdout + result.stderr
    assert not (tmp_path / "typo").exists()
