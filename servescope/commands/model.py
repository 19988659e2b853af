"""`servescope model make-tiny`: the local test model."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.tiny_model import DEFAULT_DIR, checksum, is_built, make_tiny_model
from servescope.commands.common import console


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("model", help="make the tiny local model vLLM serves in tests and demo")
    models = parser.add_subparsers(dest="model_command", required=True, metavar="SUBCOMMAND")
    make = models.add_parser(
        "make-tiny",
        help="build a 1.5M-parameter Llama model and tokenizer, deterministically",
        description="Build a tiny Llama model (random weights, fixed seed) and a byte-level BPE "
        "tokenizer with a chat template. Two builds are byte-identical.",
    )
    make.add_argument(
        "dir", nargs="?", type=Path, default=DEFAULT_DIR, help=f"(default {DEFAULT_DIR})"
    )
    make.add_argument("--force", action="store_true", help="rebuild even when the model exists")
    make.set_defaults(func=run_make_tiny)


def run_make_tiny(args: argparse.Namespace) -> int:
    if is_built(args.dir) and not args.force:
        console.print(f"tiny model already at {args.dir} (use --force to rebuild)")
    else:
        with console.status(f"building the tiny model in {args.dir}"):
            make_tiny_model(args.dir)
    print(f"{args.dir}  sha256:{checksum(args.dir)}")
    return 0
