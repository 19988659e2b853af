"""The tiny model is built locally and deterministically. Each kind is built once here, through
the CLI, and compared with the suite's own build of it (`make model`, or tests/conftest.py): two
builds made by other processes at other times. A build takes seconds of CPU, so the tests share
them."""

from pathlib import Path

import pytest

from servescope.loadgen.tiny_model import checksum
from tests.helpers.cli import servescope


@pytest.fixture(scope="module")
def builds(
    tiny_model: Path, predictable_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, Path, str]]:
    """Per kind: this module's build, the suite's, and what the CLI printed for this one."""
    folder = tmp_path_factory.mktemp("tiny")
    made = {}
    for kind, suites in (("random", tiny_model), ("predictable", predictable_model)):
        fresh = folder / kind
        out = servescope("model", "make-tiny", "--kind", kind, str(fresh), check=True).stdout
        made[kind] = (fresh, suites, out)
    return made


def _identical(fresh: Path, suites: Path) -> None:
    assert checksum(fresh) == checksum(suites), (
        f"{suites} differs from a fresh build: built by another version of make-tiny? "
        "(`make model` rebuilds it)"
    )


def test_two_builds_are_byte_identical(builds: dict) -> None:
    fresh, suites, out = builds["random"]
    _identical(fresh, suites)
    assert out.split("sha256:")[1].strip() == checksum(suites)
    files = sorted(p.name for p in fresh.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(
        files
    )


def test_make_tiny_is_idempotent(builds: dict) -> None:
    target = builds["random"][0]
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    again = servescope("model", "make-tiny", str(target), check=True)
    assert "already" in again.stderr
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp


def test_predictable_builds_are_byte_identical_and_the_default_unchanged(builds: dict) -> None:
    fresh, suites, _ = builds["predictable"]
    _identical(fresh, suites)
    default = builds["random"][0]
    assert checksum(default) != checksum(fresh)
    assert (default / "tokenizer.json").read_bytes() == (fresh / "tokenizer.json").read_bytes()


def test_predictable_model_continues_the_passage_greedily(builds: dict) -> None:
    """In transformers on the CPU, without vLLM: a prompt quoting the passage is continued by
    the passage (what n-gram drafts copy from the prompt); a decoy prompt is continued by the
    passage too, not by the decoy's own continuations (its drafts are rejected)."""
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from servescope.loadgen.prompts import decoy_text, passage_text
    from servescope.loadgen.tiny_model import PASSAGE

    model_dir = builds["predictable"][0]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    prompt = passage_text(random.Random(3), 100)
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=20, do_sample=False)
    said = tok.decode(out[0, ids.shape[1] :]).split()
    last = PASSAGE.index(prompt.split()[-1])
    assert said == [PASSAGE[(last + 1 + i) % len(PASSAGE)] for i in range(20)]
    assert " ".join(said) in " ".join(PASSAGE * 2)  # the prompt holds what the model says
    n = len(PASSAGE)
    decoy = decoy_text(random.Random(3), 3 * n).split()
    triples = [decoy[k : k + 3] for k in range(0, 3 * n, 3)]
    successor = {PASSAGE[i]: PASSAGE[(i + 1) % n] for i in range(n)}
    # every word pair the model says is in the decoy, followed by a word the model does not say
    assert {(a, b) for a, b, _ in triples} == {(w, successor[w]) for w in PASSAGE}
    assert all(c != successor[b] for _, b, c in triples)
