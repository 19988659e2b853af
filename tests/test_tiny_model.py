"""The tiny model is built locally and deterministically."""

from pathlib import Path

from servescope.loadgen.tiny_model import checksum
from tests.conftest import servescope


def test_two_builds_are_byte_identical(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    out_a = servescope("model", "make-tiny", str(first), check=True).stdout
    out_b = servescope("model", "make-tiny", str(second), check=True).stdout
    assert checksum(first) == checksum(second)
    assert out_a.split("sha256:")[1] == out_b.split("sha256:")[1]
    files = sorted(p.name for p in first.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(
        files
    )


def test_make_tiny_is_idempotent(tmp_path: Path) -> None:
    target = tmp_path / "m"
    servescope("model", "make-tiny", str(target), check=True)
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    again = servescope("model", "make-tiny", str(target), check=True)
    assert "already" in again.stderr
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp


def test_predictable_builds_are_byte_identical_and_the_default_unchanged(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    servescope("model", "make-tiny", "--kind", "predictable", str(first), check=True)
    servescope("model", "make-tiny", "--kind", "predictable", str(second), check=True)
    assert checksum(first) == checksum(second)
    default = tmp_path / "default"
    servescope("model", "make-tiny", str(default), check=True)
    assert checksum(default) != checksum(first)
    assert (default / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()


def test_predictable_model_continues_the_passage_greedily(tmp_path: Path) -> None:
    """In transformers on the CPU, without vLLM: a prompt quoting the passage is continued by
    the passage (what n-gram drafts copy from the prompt); a decoy prompt is continued by the
    passage too, not by the decoy's own continuations (its drafts are rejected)."""
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from servescope.loadgen.prompts import decoy_text, passage_text
    from servescope.loadgen.tiny_model import PASSAGE, make_tiny_model

    model_dir = make_tiny_model(tmp_path / "p", kind="predictable")
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
