"""Operators' own experiments and profiles files, without a vLLM: run through the same path as
the built-in ones, listed, and every way they can be wrong said in one line with exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from servescope.cli import main
from servescope.loadgen.experiment import Experiment
from servescope.loadgen.launcher import (
    ProfileError,
    load_profiles,
)
from servescope.loadgen.spec import (
    ExperimentError,
    load_experiments,
    read_experiments_file,
)
from servescope.store import Store
from tests.helpers.experiments import (
    FakeBench,
    ResetServer,
)

# -- operators' own experiments and profiles ----------------------------------------------------

GOOD_PROFILES = """
profiles:
  my-base:
    description: my model's serving flags
    extends: default
    flags: [--max-model-len, "4096"]
  my-big-batch:
    extends: my-base
    flags: [--max-num-seqs, "64"]
"""
GOOD_EXPERIMENTS = """
experiments:
  my-flip:
    description: my batch size, before and after
    workload: my-workload.yaml
    profiles: [my-base, my-big-batch]
    model: my-model
    requests: 4
"""
WORKLOAD = """
workloads:
  - {name: w, input_tokens: 32, output_tokens: 8, concurrency: [1], requests_per_level: 4}
"""


def _cli(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.fixture
def operator_files(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "my-experiments.yaml").write_text(GOOD_EXPERIMENTS)
    (tmp_path / "my-profiles.yaml").write_text(GOOD_PROFILES)
    (tmp_path / "my-workload.yaml").write_text(WORKLOAD)
    (tmp_path / "my-model").mkdir()
    return {"experiments": tmp_path / "my-experiments.yaml",
            "profiles": tmp_path / "my-profiles.yaml"}  # fmt: skip


def test_an_operators_experiment_runs_through_the_same_path(
    operator_files: dict[str, Path], tmp_path: Path, reset_servers: list[ResetServer]
) -> None:
    experiments = load_experiments(operator_files["experiments"])
    assert "prefix-caching" in experiments  # the built-in ones stay
    spec = experiments["my-flip"]
    assert spec.repeats is None and spec.source == str(operator_files["experiments"])
    assert spec.workload == str(tmp_path / "my-workload.yaml")  # beside the file
    assert spec.model == str(tmp_path / "my-model")
    profiles = load_profiles(operator_files["profiles"])
    assert profiles["my-big-batch"].flags[-2:] == ["--max-num-seqs", "64"]
    assert "--max-model-len" in profiles["my-big-batch"].flags  # extends mine, which extends
    assert "--enable-prefix-caching" in profiles["my-big-batch"].flags  # a built-in one
    a, b = ResetServer(), ResetServer()
    reset_servers += [a, b]
    store = Store(tmp_path / "s.duckdb")
    result = Experiment(
        spec,
        store=store,
        execute=FakeBench(store),
        model=Path(spec.model),
        targets={"my-base": a.url, "my-big-batch": b.url},
        profiles=profiles,
    ).run()
    assert result.status == "complete" and result.order == "A B B A A B"
    with store.read() as con:
        flips = con.execute("SELECT lever, before, after FROM lever_flips ORDER BY ts").fetchall()
    assert flips == [  # A B, B A, A B
        ("max_num_seqs", "default", "64"), ("max_num_seqs", "64", "default"),
        ("max_num_seqs", "default", "64"),
    ]  # fmt: skip


def test_list_shows_an_operators_experiments(
    operator_files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _cli("experiment", "list", "--file", str(operator_files["experiments"]),
                     capsys=capsys)  # fmt: skip
    assert code == 0
    assert "my-flip:" in out and "my-base vs my-big-batch, repeats until decided" in out
    assert "aa: ralph-loop x default vs default" in out


@pytest.mark.parametrize(
    ("experiments", "profiles", "message"),
    [
        (None, None, "no such experiments file"),
        ("experiments: [oops", None, "not valid YAML"),
        ("- just a list", None, "expected a mapping `experiments:`"),
        ("experiments:\n  e: {profiles: [default, default]}", None, "missing `workload`"),
        ("experiments:\n  e: {workload: rag}", None, "missing `profiles`"),
        ("experiments:\n  e: {workload: rag, profiles: [default]}", None, "at least two"),
        (
            "experiments:\n  e: {workload: rag, profiles: [a, b], repets: 3}",
            None,
            "experiment 'e': unknown key 'repets' (known: description",
        ),
        (
            "experiments:\n  e: {workload: rag, profiles: [default, default], repeats: 0}",
            None,
            "experiment 'e': repeats: expected an integer ≥ 1, got 0",
        ),
        (
            "experiments:\n  e: {workload: rag, profiles: [default, default], scale: big}",
            None,
            "experiment 'e': scale: expected a number, got \"big\"",
        ),
        (
            "experiments:\n  e: {workload: rag, profiles: [default, nope]}",
            None,
            "unknown profiles ['nope']",
        ),
        (
            "experiments:\n  e: {workload: no-such-workload, profiles: [default, default]}",
            None,
            "no such workload file",
        ),
        ("experiments:\n  e: 3", None, "experiment 'e': expected a mapping, got 3"),
        ("experiments:\n  e: {workload: rag, profiles: [default, mine]}", None, "unknown exp"),
        (
            "experiments:\n  e: {workload: rag, profiles: [default, mine]}",
            "profiles: [",
            "not valid YAML",
        ),
        (
            "experiments:\n  e: {workload: rag, profiles: [default, mine]}",
            "nothing: here",
            "expected a mapping `profiles:`",
        ),
        (
            "experiments:\n  e: {workload: rag, profiles: [default, mine]}",
            "profiles:\n  mine: {extends: nowhere}",
            "extends unknown profile 'nowhere'",
        ),
        (
            "experiments:\n  e: {workload: rag, profiles: [default, mine]}",
            "profiles:\n  mine: {flags: --max-num-seqs}",
            "profile 'mine': flags: expected a list, got \"--max-num-seqs\"",
        ),
        (
            "experiments:\n  e: {workload: rag, profiles: [default, mine]}",
            "profiles:\n  mine: {extends: mine}",
            "profile cycle",
        ),
        (
            "experiments:\n  e: {workload: rag, profiles: [default, mine]}",
            "profiles:\n  mine: {flag: [--x]}",
            "profile 'mine': unknown key 'flag' (known: description",
        ),
        (
            "experiments:\n  e: {workload: rag, profiles: [default, mine]}",
            None,
            "unknown profiles ['mine']",
        ),
    ],
)
def test_a_bad_file_is_one_red_line_and_exit_2(
    experiments: str | None,
    profiles: str | None,
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    efile, pfile = tmp_path / "e.yaml", tmp_path / "p.yaml"
    if experiments is not None:
        efile.write_text(experiments)
    args = ["experiment", "run", "e", "--file", str(efile), "--store", str(tmp_path / "s.db")]
    if profiles is not None:
        pfile.write_text(profiles)
        args += ["--profiles", str(pfile)]
    if message == "unknown exp":
        args[2], message = "no-such", "unknown experiment 'no-such'"
        args += ["--profiles", str(tmp_path / "missing.yaml")] if profiles is None else []
        message = "no such profiles file" if profiles is None else message
    code, out = _cli(*args, capsys=capsys)
    assert code == 2, out
    assert message in out, out
    assert "Traceback" not in out
    assert len(out.strip().splitlines()) <= 2, out  # one line (wrapped at most once)
    if experiments is not None and profiles is None and "list" not in args:
        code, listed = _cli("experiment", "list", "--file", str(efile), capsys=capsys)
        assert "Traceback" not in listed and code in (0, 2)


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--repeats", "0"], "--repeats must be positive"),
        (["--requests", "0"], "--requests must be positive"),
        (["--scale", "-1"], "--scale must be positive"),
        (["--target", "nothing"], "--target takes ARM=URL"),
        (["--target", "default-a=http://127.0.0.1:9"], "no --target for arms ['default-b']"),
    ],
)
def test_a_bad_option_is_exit_2_before_any_server_starts(
    option: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _cli("experiment", "run", "aa", *option, "--store", str(tmp_path / "s.db"),
                     capsys=capsys)  # fmt: skip
    assert code == 2 and message in out and "Traceback" not in out, out


def test_a_missing_profiles_file_is_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _cli("experiment", "list", "--profiles", str(tmp_path / "nope.yaml"),
                     capsys=capsys)  # fmt: skip
    assert code == 2 and "no such profiles file" in out and "Traceback" not in out


def test_read_experiments_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ExperimentError, match=str(path)):
        read_experiments_file(path)
    path.write_text("profiles:\n  p: {servers: [{port: 1}]}")
    with pytest.raises(ProfileError, match=r"servers\[0\]: missing `mig_uuid`"):
        load_profiles(path)
