"""`servescope model make-tiny`: the local test model."""

from __future__ import annotations

import argparse
from pathlib import Path

from servescope.commands.common import console
from servescope.loadgen.tiny_model import KINDS, checksum, is_built, make_tiny_model, model_dir


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("model", help="make the tiny local model vLLM serves in tests and demo")
    models = parser.add_subparsers(dest="model_command", required=True, metavar="SUBCOMMAND")
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


def run_make_tiny(args: argparse.Namespace) -> int:
    target = args.dir or model_dir(args.kind)
    if is_built(target) and not args.force:
        console.print(f"tiny model already at {target} (use --force to rebuild)")
    else:
        with console.status(f"building the {args.kind} tiny model in {target}"):
            make_tiny_model(target, kind=args.kind)
    print(f"{target}  sha256:{checksum(target)}")
    return 0
