"""Experiments' repeats without a vLLM: the interleaved order (A B B A …), the per-run notes
(how each repeat started, how servers and rounds were sequenced), the A/A spec, the repeats
default, and the console table built from the reports' own numbers (operators' own files:
test_experiment_files.py)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from servescope.commands import experiment as command
from servescope.loadgen import experiment as loadgen_experiment
from servescope.loadgen.experiment import FRESH, KEPT_UP, SLEEP, TARGETS, Experiment
from servescope.loadgen.runner import RunOptions, RunResult
from servescope.loadgen.sequence import (
    ExperimentHooks,
    ExperimentResult,
    ExperimentRun,
    interleaved,
    order_letters,
)
from servescope.loadgen.servers import (
    STATE_FRESH,
    STATE_REFUSED,
    STATE_RESET,
    STATE_WARM,
    STATE_WOKEN,
    SleepFailed,
    is_sleeping,
    reset_prefix_cache,
    set_sleeping,
)
from servescope.loadgen.spec import (
    ExperimentError,
    arm_names,
    load_experiments,
)
from servescope.reports import build_summary
from servescope.reports import experiment as experiment_reports
from servescope.reports.experiment import (
    outcome_rows,
    primary_level,
    shown_indicators,
    verdict_rows,
)
from servescope.reports.outcome import run_labels, verdict_table
from servescope.store import Store
from tests.helpers.experiments import (
    FakeBench,
    FakeServer,
    ResetServer,
)

# -- a server that answers vLLM's dev-mode endpoints as vLLM does (or not, without dev mode):
# POST /reset_prefix_cache, and with sleep mode POST /sleep?level=N, POST /wake_up and
# GET /is_sleeping --


class FakeSidecar:
    def __init__(self, log: Path, url: str) -> None:
        self.log, self.url = log, url
        self.flags = ["--otlp-traces-endpoint", f"http://127.0.0.1:1/{log.name}"]
        self.env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
        self.settled: list[str] = []
        self.closed = False

    def settle(self, run_id: str) -> None:
        self.settled.append(run_id)

    def close(self) -> None:
        self.closed = True


# -- a bench run without a server: synthetic requests stored as bench stores them ------------


# -- the order ---------------------------------------------------------------------------------


def test_repeats_interleave_abba_so_a_linear_drift_cancels() -> None:
    assert order_letters(["a", "b"], 3) == "A B B A A B"
    assert order_letters(["a", "b"], 4) == "A B B A A B B A"
    assert order_letters(["a", "b", "c"], 2) == "A B C C B A"
    assert interleaved(["x", "y"], 2) == [(1, "x"), (1, "y"), (2, "y"), (2, "x")]
    # a drift of +1 per run position: A B B A gives both arms the same mean position
    positions: dict[str, list[int]] = {}
    for position, (_repeat, arm) in enumerate(interleaved(["a", "b"], 4)):
        positions.setdefault(arm, []).append(position)
    assert sum(positions["a"]) == sum(positions["b"])


def test_every_built_in_experiment_repeats_until_decided() -> None:
    experiments = load_experiments()
    assert all(spec.repeats is None for spec in experiments.values()), {
        n: s.repeats for n, s in experiments.items()
    }
    with pytest.raises(ExperimentError, match="--repeats must be positive"):
        Experiment(
            experiments["prefix-caching"],
            store=None,  # type: ignore[arg-type]
            execute=None,  # type: ignore[arg-type]
            model=Path("m"),
            repeats=0,
        )


def test_the_aa_experiment_runs_one_profile_as_two_named_arms() -> None:
    spec = load_experiments()["aa"]
    assert spec.profiles == ["default", "default"]
    assert spec.arms == ["default-a", "default-b"]
    assert spec.repeats is None  # until decided
    assert arm_names(["x", "y", "x"]) == ["x-a", "y", "x-b"]


# -- the designs: rounds, notes, flips -----------------------------------------------------------


def test_kept_up_servers_one_start_per_arm_and_a_reset_before_every_run(
    tmp_path: Path, fake_servers: list[FakeServer]
) -> None:
    store = Store(tmp_path / "s.duckdb")
    bench = FakeBench(store)
    sidecars: list[FakeSidecar] = []

    def sidecar(log: Path, url: str) -> FakeSidecar:
        sidecars.append(FakeSidecar(log, url))
        return sidecars[-1]

    exp = Experiment(
        load_experiments()["prefix-caching"],
        store=store,
        execute=bench,
        model=tmp_path,
        hooks=ExperimentHooks(sidecar=sidecar),
    )
    result = exp.run()
    assert result.status == "complete", result.failure
    assert result.design == KEPT_UP and result.order == "A B B A A B"
    assert [(r.arm, r.repeat) for r in result.runs] == [
        ("no-prefix-caching", 1), ("default", 1), ("default", 2),
        ("no-prefix-caching", 2), ("no-prefix-caching", 3), ("default", 3),
    ]  # fmt: skip
    # one server per arm, started once, stopped at the end, each with its own port, log, sidecar
    assert len(fake_servers) == 2 and all(s.starts == 1 and s.stops == 1 for s in fake_servers)
    assert len({s.port for s in fake_servers}) == 2
    assert len({s.log_path for s in fake_servers}) == 2
    assert [s.log for s in sidecars] == [s.log_path for s in fake_servers]
    assert all(s.env["VLLM_SERVER_DEV_MODE"] == "1" for s in fake_servers)
    assert all("--otlp-traces-endpoint" in s.flags for s in fake_servers)
    assert all(s.http.resets == 3 for s in fake_servers)  # before each of its arm's runs
    for sc, server in zip(sidecars, fake_servers, strict=True):
        # each sidecar watches its own server (its URL) and settles that arm's runs only
        assert sc.closed and sc.url == f"http://127.0.0.1:{server.port}"
        assert {r.arm for r in result.runs if r.run_id in sc.settled} == {server.profile.name}
        assert len(sc.settled) == 3
    notes = [store.run(r.run_id)["notes"] for r in result.runs]
    assert [n["repeat_state"] for n in notes] == [STATE_RESET] * 6
    assert {n["repeat_design"] for n in notes} == {KEPT_UP}
    assert [n["server_runs_before"] for n in notes] == [0, 0, 1, 1, 2, 2]
    assert [n["position"] for n in notes] == [1, 2, 3, 4, 5, 6]
    assert {n["order"] for n in notes} == {"A B B A A B"}
    assert [n["arm"] for n in notes] == [r.arm for r in result.runs]
    with store.read() as con:
        flips = con.execute(
            "SELECT lever, before, after, run_id, before_run_id FROM lever_flips ORDER BY ts"
        ).fetchall()
    ids = [r.run_id for r in result.runs]
    assert flips == [  # at each switch of arm, none between two runs of one arm
        ("enable_prefix_caching", "False", "True", ids[1], ids[0]),
        ("enable_prefix_caching", "True", "False", ids[3], ids[2]),
        ("enable_prefix_caching", "False", "True", ids[5], ids[4]),
    ]
    # the pooled comparison holds every repeat of each arm; a pair per repeat beside it
    (comparison,) = result.comparisons()
    assert (comparison.before, comparison.after) == ("no-prefix-caching", "default")
    assert [r.repeat for r in comparison.before_runs] == [1, 2, 3]
    assert [(b.repeat, a.repeat) for b, a in result.pairs()] == [(1, 1), (2, 2), (3, 3)]


def test_fresh_servers_start_per_run_and_say_so(
    tmp_path: Path, fake_servers: list[FakeServer]
) -> None:
    store = Store(tmp_path / "s.duckdb")
    exp = Experiment(
        load_experiments()["max-num-seqs"],
        store=store,
        execute=FakeBench(store),
        model=tmp_path,
        repeats=2,
        fresh_servers=True,
    )
    result = exp.run()
    assert result.status == "complete" and result.design == FRESH
    assert [r.arm for r in result.runs] == [
        "max-num-seqs-2", "max-num-seqs-8", "max-num-seqs-32",
        "max-num-seqs-32", "max-num-seqs-8", "max-num-seqs-2",
    ]  # fmt: skip
    assert len(fake_servers) == 6 and all(s.starts == s.stops == 1 for s in fake_servers)
    assert all("VLLM_SERVER_DEV_MODE" not in s.env for s in fake_servers)
    notes = [store.run(r.run_id)["notes"] for r in result.runs]
    assert {n["repeat_state"] for n in notes} == {STATE_FRESH}
    assert {n["repeat_design"] for n in notes} == {FRESH}
    # three arms: two pooled comparisons (2 → 8, 8 → 32), each with both repeats
    assert [(c.before, c.after, len(c.before_runs), len(c.after_runs))
            for c in result.comparisons()] == [
        ("max-num-seqs-2", "max-num-seqs-8", 2, 2), ("max-num-seqs-8", "max-num-seqs-32", 2, 2)
    ]  # fmt: skip


def test_gpu_servers_start_once_in_turn_and_sleep_while_the_other_arm_runs(
    tmp_path: Path, fake_servers: list[FakeServer]
) -> None:
    """A GPU's arms: each server started once, one after the other with the one before asleep
    (vLLM sizes its KV cache from the memory free at its start); before each run the server
    awake sleeps and the run's own wakes, then its prefix cache is reset; never two awake."""
    store = Store(tmp_path / "s.duckdb")
    sidecars: list[FakeSidecar] = []
    shown: list[tuple[str, str]] = []

    def sidecar(log: Path, url: str) -> FakeSidecar:
        sidecars.append(FakeSidecar(log, url))
        return sidecars[-1]

    exp = Experiment(
        load_experiments()["prefix-caching-gpu"],
        store=store,
        execute=FakeBench(store),
        model=tmp_path,
        repeats=3,
        hooks=ExperimentHooks(
            sidecar=sidecar,
            slept=lambda arm, _seconds: shown.append(("asleep", arm)),
            woke=lambda arm, _seconds: shown.append(("awake", arm)),
        ),
    )
    assert exp.design == SLEEP
    result = exp.run()
    assert result.status == "complete", result.failure
    assert result.design == SLEEP and result.order == "A B B A A B"
    a, b = "gpu-bench-no-prefix-caching", "gpu-bench"
    sleep, wake, reset = "/sleep?level=1", "/wake_up", "/reset_prefix_cache"
    assert FakeServer.calls == [
        (b, "start"), (b, sleep), (a, "start"),  # the first run's arm starts last, stays awake
        (a, reset),  # A r1
        (a, sleep), (b, wake), (b, reset),  # B r1
        (b, reset),  # B r2: awake already
        (b, sleep), (a, wake), (a, reset),  # A r2
        (a, reset),  # A r3
        (a, sleep), (b, wake), (b, reset),  # B r3
    ]  # fmt: skip
    awake: set[str] = set()
    for name, call in FakeServer.calls:  # one server awake at a time, and each run's own
        if call in ("start", wake):
            awake.add(name)
        elif call == sleep:
            awake.discard(name)
        assert len(awake) <= 1, FakeServer.calls
        if call == reset:
            assert awake == {name}
    assert shown == [("asleep", b), ("asleep", a), ("awake", b), ("asleep", b), ("awake", a),
                     ("asleep", a), ("awake", b)]  # fmt: skip
    # each server started once, stopped at the end, in sleep mode, with its own port and sidecar
    assert len(fake_servers) == 2 and all(s.starts == 1 and s.stops == 1 for s in fake_servers)
    assert all(s.env["VLLM_SERVER_DEV_MODE"] == "1" for s in fake_servers)
    assert all("--enable-sleep-mode" in s.flags for s in fake_servers)
    assert len({s.port for s in fake_servers}) == 2
    assert [s.log for s in sidecars] == [s.log_path for s in fake_servers]
    assert all(len(sc.settled) == 3 and sc.closed for sc in sidecars)
    notes = [store.run(r.run_id)["notes"] for r in result.runs]
    assert [n["repeat_state"] for n in notes] == [
        STATE_RESET, STATE_WOKEN, STATE_RESET, STATE_WOKEN, STATE_RESET, STATE_WOKEN,
    ]  # fmt: skip
    assert {n["repeat_design"] for n in notes} == {SLEEP}
    assert [n["server_runs_before"] for n in notes] == [0, 0, 1, 1, 2, 2]
    assert [sorted(k for k in n if k.endswith("_s")) for n in notes] == [
        [], ["sleep_s", "wake_s"], [], ["sleep_s", "wake_s"], [], ["sleep_s", "wake_s"],
    ]  # fmt: skip
    assert all(n["wake_s"] >= 0 and n["sleep_s"] >= 0 for n in notes if "wake_s" in n)
    # sleep mode is how the servers ran: a lever both arms share, so no flip of it
    assert all(r.levers["enable_sleep_mode"] is True for r in result.runs)
    with store.read() as con:
        flips = con.execute("SELECT DISTINCT lever FROM lever_flips").fetchall()
    assert flips == [("enable_prefix_caching",)]


def test_gpu_profiles_with_fresh_servers_start_one_per_run(tmp_path: Path) -> None:
    spec = load_experiments()["prefix-caching-gpu"]
    store = Store(tmp_path / "s.duckdb")
    exp = Experiment(spec, store=store, execute=None, model=tmp_path, fresh_servers=True)  # type: ignore[arg-type]
    assert exp.design == FRESH and exp.repeats == 3


def test_a_server_without_sleep_mode_fails_the_experiment_in_a_line(
    tmp_path: Path, fake_servers: list[FakeServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loadgen_experiment, "SLEEP_FLAGS", [])  # started without the flag
    store = Store(tmp_path / "s.duckdb")
    result = Experiment(
        load_experiments()["prefix-caching-gpu"],
        store=store,
        execute=FakeBench(store),
        model=tmp_path,
        repeats=1,
    ).run()
    assert result.status == "failed" and not result.runs
    assert "/sleep?level=1 answered 500: sleep mode needs --enable-sleep-mode" in str(
        result.failure
    )
    assert all(s.stops == 1 for s in fake_servers)  # the one started is stopped


def test_set_sleeping_waits_until_the_server_says_so(reset_servers: list[ResetServer]) -> None:
    server, plain = ResetServer(sleep_mode=True), ResetServer(dev_mode=False)
    reset_servers += [server, plain]
    assert not is_sleeping(server.url)
    assert set_sleeping(server.url, asleep=True) >= 0 and is_sleeping(server.url)
    assert set_sleeping(server.url, asleep=False) >= 0 and not is_sleeping(server.url)
    assert server.calls == [("", "/sleep?level=1"), ("", "/wake_up")]
    with pytest.raises(SleepFailed, match="answered 404"):
        set_sleeping(plain.url, asleep=True)
    with pytest.raises(SleepFailed, match="is_sleeping answered 404"):
        is_sleeping(plain.url)


def test_targets_are_reset_where_they_can_be_and_say_warm_where_not(
    tmp_path: Path, reset_servers: list[ResetServer]
) -> None:
    dev, plain = ResetServer(dev_mode=True, refuse_first=1), ResetServer(dev_mode=False)
    reset_servers += [dev, plain]
    store = Store(tmp_path / "s.duckdb")
    exp = Experiment(
        load_experiments()["aa"],
        store=store,
        execute=FakeBench(store),
        model=tmp_path,
        targets={"default-a": dev.url, "default-b": plain.url},
        repeats=2,
    )
    result = exp.run()
    assert result.status == "complete", result.failure
    assert result.design == TARGETS
    assert [(r.arm, r.repeat, r.target) for r in result.runs] == [
        ("default-a", 1, dev.url), ("default-b", 1, plain.url),
        ("default-b", 2, plain.url), ("default-a", 2, dev.url),
    ]  # fmt: skip
    notes = {r.run_id: store.run(r.run_id)["notes"] for r in result.runs}
    states = [notes[r.run_id]["repeat_state"] for r in result.runs]
    assert states == [STATE_RESET, STATE_WARM, STATE_WARM, STATE_RESET]
    assert dev.resets == 3  # one refusal (blocks in use), retried
    # A/A: distinct run ids, no lever changed, so no lever_flips row
    assert len({r.run_id for r in result.runs}) == 4
    assert all("-aa-default-" in r.run_id for r in result.runs)
    with store.read() as con:
        assert con.execute("SELECT count(*) FROM lever_flips").fetchone() == (0,)


def test_a_reset_vllm_keeps_refusing_is_recorded_not_hidden(
    reset_servers: list[ResetServer],
) -> None:
    stuck = ResetServer(dev_mode=True, refuse_first=1000)
    reset_servers.append(stuck)
    assert reset_prefix_cache(stuck.url, attempts=3, wait_s=0.0) == STATE_REFUSED
    assert stuck.resets == 3


def test_targets_must_name_the_arms(tmp_path: Path) -> None:
    kwargs: dict[str, Any] = {"store": None, "execute": None, "model": tmp_path}
    with pytest.raises(ExperimentError, match=r"no --target for arms \['default-b'\]"):
        Experiment(load_experiments()["aa"], targets={"default-a": "http://x"}, **kwargs)
    with pytest.raises(ExperimentError, match="which is no arm"):
        Experiment(
            load_experiments()["aa"],
            targets={"default-a": "http://x", "default-b": "http://y", "default": "http://z"},
            **kwargs,
        )


def test_a_server_that_fails_to_start_fails_the_experiment_and_stops_the_others(
    tmp_path: Path, fake_servers: list[FakeServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    def start(self: FakeServer) -> FakeServer:
        if self.profile.name == "default":
            raise RuntimeError("vLLM exited with code 1 before it was ready")
        return self

    monkeypatch.setattr(FakeServer, "start", start)
    store = Store(tmp_path / "s.duckdb")
    result = Experiment(
        load_experiments()["prefix-caching"], store=store, execute=FakeBench(store), model=tmp_path
    ).run()
    assert result.status == "failed" and "exited with code 1" in (result.failure or "")
    assert result.runs == [] and all(s.stops >= 1 for s in fake_servers)


# -- one computation: the console table from the reports ----------------------------------------


def test_the_table_shows_the_reports_numbers_and_only_rows_that_mean_something(
    tmp_path: Path, reset_servers: list[ResetServer]
) -> None:
    a, b = ResetServer(), ResetServer()
    reset_servers += [a, b]
    store = Store(tmp_path / "s.duckdb")
    levers = {"no-prefix-caching": {"enable_prefix_caching": False},
              "default": {"enable_prefix_caching": True}}  # fmt: skip
    result = Experiment(
        load_experiments()["prefix-caching"],
        store=store,
        execute=FakeBench(store, levers),
        model=tmp_path,
        targets={"no-prefix-caching": a.url, "default": b.url},
    ).run()
    assert result.status == "complete"
    reports = command.report(store, result, tmp_path / "reports")
    assert not reports.failures, reports.failures
    (pooled,) = reports.pooled
    assert len(reports.repeats) == 3 and pooled.page.exists()
    assert pooled.before == [r.run_id for r in result.runs if r.arm == "no-prefix-caching"]
    assert (pooled.report.get("repeats") or {}).get("before") in (3, None)
    rows = outcome_rows(store, command.arms_of(result), reports)
    assert [r["run_id"] for r in rows] == [r.run_id for r in result.runs]
    for row in rows:  # every figure is the run's own report summary's
        summary = build_summary(store, row["run_id"])
        assert row["ttft_ms_p50"] == summary["overall"]["ttft_ms"]["p50"]
        assert row["ttft_ms_p95"] == summary["overall"]["ttft_ms"]["p95"]
        assert row["ttft_source"] == summary["overall"]["sources"]["ttft_ms"] == "client"
        assert row["tpot_ms_p50"] == summary["overall"]["tpot_ms"]["p50"]
        assert row["client_cached_token_ratio"] == summary["overall"]["cached_token_ratio"]
        (probe,) = [g for g in summary["groups"] if g["workload"] == "mixed:probe"]
        assert row["probe_ttft_ms_p50"] == probe["ttft_ms"]["p50"]
        assert row["repeat_state"] == STATE_RESET
    shown = [h for h, _k, _f in shown_indicators(rows)]
    assert "probe TTFT p50 ms" in shown and "draft acceptance" not in shown
    no_probes = [{**r, "probe_ttft_ms_p50": None, "has_probes": False} for r in rows]
    assert "probe TTFT p50 ms" not in [h for h, _k, _f in shown_indicators(no_probes)]
    # the pooled verdicts are the pooled report's own rows, at its primary indicator's level
    level = primary_level(pooled.report)
    assert level == "all levels (stratified)"  # the primary: every level, weighted
    probe_level = next(r["level"] for r in pooled.report["diff"] if ":probe" in r["level"])
    by_key = {v["key"]: v for v in verdict_rows(pooled.report)}
    for key, metric, at in [
        ("ttft_ms_p50", "ttft_ms.p50", level),
        ("probe_ttft_ms_p50", "ttft_ms.p50", probe_level),
        ("tpot_ms_p50", "tpot_ms.p50", level),
    ]:
        (row,) = [r for r in pooled.report["diff"] if r["metric"] == metric and r["level"] == at]
        assert {k: by_key[key][k] for k in row} == row
    assert by_key["ttft_ms_p50"]["after"] < by_key["ttft_ms_p50"]["before"]
    assert "server_prefix_cache_hit_ratio" not in by_key  # measured on neither side: left out
    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=False)
    console.print(verdict_table(pooled, shown_indicators(rows)))
    text = out.getvalue()
    assert "TTFT p50 ms" in text and "probe TTFT p50 ms" in text
    assert "…" not in text.replace("…+", "").replace("…−", ""), text  # no cell cut short
    assert max(len(line) for line in text.splitlines()) <= 80, text


def test_a_failed_pooled_report_is_a_line_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(tmp_path / "s.duckdb")
    bench = FakeBench(store)
    runs = []
    for i, arm in enumerate(["x", "y", "y", "x"]):
        run = ExperimentRun(arm, 1 + i // 2, f"run-t-{arm}-r{1 + i // 2}", {}, "t")
        bench(None, "t", store, RunOptions(run_id=run.run_id, label=arm,
                                           notes={"profile": arm, "arm": arm}))  # fmt: skip
        run.result = RunResult(run.run_id, Path("unused"), events=40)
        runs.append(run)
    result = ExperimentResult("t", "exp-t", runs=runs, arms=["x", "y"])

    def broken(store: Store, after: Any, before: Any, *args: Any) -> Any:
        if isinstance(after, list):
            raise ValueError("pooling not supported")
        return real(store, after, before, *args)

    real = experiment_reports.build_diff
    monkeypatch.setattr(experiment_reports, "build_diff", broken)
    reports = command.report(store, result, tmp_path / "out")
    assert reports.pooled == [] and len(reports.repeats) == 2
    assert reports.failures == ["pooled report x → y: ValueError: pooling not supported"]


def test_the_run_table_labels_arms_and_repeats() -> None:
    rows = [
        {"profile": "default", "arm": arm, "repeat": r, "requests": 1}
        for r in (1, 2) for arm in ("default-a", "default-b")
    ]  # fmt: skip
    assert run_labels(rows) == [
        "default-a r1", "default-b r1", "default-a r2", "default-b r2"
    ]  # fmt: skip
    assert run_labels(rows[:2]) == ["default-a", "default-b"]


def test_a_fleet_experiment_interleaves_and_resets_its_replicas(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_servers: list[FakeServer]
) -> None:
    """The routing experiment: replicas started once, one gateway per run, the replicas'
    prefix caches reset before every run, policies in A B B A order."""
    from servescope.loadgen import fleet

    class FakeGateway:
        def __init__(self, config: dict, folder: Path, _store: Store) -> None:
            self.config_path, self.url = folder / "gateway.yaml", "http://gateway"
            self.policy = next(iter(config["models"].values()))["routing"]

        def start(self) -> FakeGateway:
            return self

        def stop(self) -> None:
            pass

    def replica(model: Any, *, extra_flags: list[str] | None, **kw: Any) -> FakeServer:
        served_name = kw.pop("served_name")
        server = FakeServer(model, extra_flags=extra_flags or [], **kw)
        server.served_name = served_name  # type: ignore[attr-defined]
        return server

    monkeypatch.setattr(fleet, "VllmServer", replica)
    monkeypatch.setattr(fleet, "GatewayProcess", FakeGateway)
    monkeypatch.setenv("SERVESCOPE_DATA_DIR", str(tmp_path))
    store = Store(tmp_path / "s.duckdb")
    result = fleet.FleetExperiment(
        load_experiments()["routing"],
        store=store,
        execute=FakeBench(store),
        model=tmp_path,
    ).run()
    assert result.status == "complete", result.failure
    assert result.order == "A B B A A B" and result.design == loadgen_experiment.FLEET
    assert [r.profile for r in result.runs] == [
        "round-robin", "prefix-affinity", "prefix-affinity",
        "round-robin", "round-robin", "prefix-affinity",
    ]  # fmt: skip
    assert len(fake_servers) == 2 and all(s.http.resets == 6 for s in fake_servers)
    notes = [store.run(r.run_id)["notes"] for r in result.runs]
    assert {n["repeat_state"] for n in notes} == {STATE_RESET}
    assert {n["repeat_design"] for n in notes} == {loadgen_experiment.FLEET}
    assert [c.before for c in result.comparisons()] == ["round-robin"]
