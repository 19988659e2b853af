"""`servescope gateway`: the admission-control proxy (the logic lives in `gateway/`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from servescope.commands.common import console, store_command
from servescope.gateway import ConfigError, Gateway, load_config, serve
from servescope.gateway.config import key_digest
from servescope.store import Store

DESCRIPTION = """\
An OpenAI-compatible proxy (/v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics) in front of one or more vLLM servers, routed by `model`. Before each request it decides:
admit, queue (strict priority between classes, weighted fair queueing between teams, FIFO within
a team) or reject — 429 + Retry-After for the team's own limits (queue_full, token_budget), 413
for prompt_too_long, 503 + Retry-After for queue_timeout / upstream_unavailable, 401 for an
unknown key. Streams pass through chunk by chunk. Every request is one event in
<events_dir>/gateway-<date>.events.jsonl; rejections count in admission_rejected_total{team,reason}.
SIGHUP reloads the config without dropping streams; a reload that changes a model's routing
policy is a `routing` lever flip in the store (--store). A model may route to a pool of replicas
(round-robin, least-outstanding or prefix-affinity; gateway/routing.py). See gateway/config.py
for the file format.
Exit codes: 0 stopped by SIGINT/SIGTERM (or --check/--hash-key done), 1 cannot listen, 2 a bad
config file or usage.
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "gateway",
        help="run the admission-control gateway in front of vLLM",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, help="gateway.yaml (required to serve)")
    parser.add_argument(
        "--port", type=int, default=None, help="listen port (default: config, 8080)"
    )
    parser.add_argument("--host", default=None, help="listen address (default: config, 127.0.0.1)")
    parser.add_argument("--check", action="store_true", help="validate the config and exit")
    parser.add_argument(
        "--hash-key",
        action="store_true",
        help="read an API key on stdin and print its SHA-256 for `key_sha256` (keys stay out of "
        "config files)",
    )
    store_command(parser, run_gateway)


def run_gateway(args: argparse.Namespace) -> int:
    if args.hash_key:
        key = sys.stdin.readline().strip()
        if not key:
            console.print("no key on stdin", style="red")
            return 2
        print(key_digest(key))
        return 0
    if args.config is None:
        console.print("--config gateway.yaml is required", style="red")
        return 2
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        console.print(f"{exc}", style="red")
        return 2
    host = args.host or config.host
    port = config.port if args.port is None else args.port
    if args.check:
        console.print(
            f"{args.config}: ok — {len(config.teams)} teams, {len(config.upstreams)} upstreams, "
            f"models {', '.join(sorted(config.routes))}"
        )
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    gateway = Gateway(config, args.config, Store(args.store))
    try:
        _run(gateway, host, port)
    except OSError as exc:
        console.print(f"cannot listen on {host}:{port}: {exc}", style="red")
        return 1
    return 0


def _run(gateway: Gateway, host: str, port: int) -> None:
    try:
        import uvloop  # the faster event loop when installed (it comes with vLLM)
    except ImportError:
        asyncio.run(serve(gateway, host, port))
    else:
        uvloop.run(serve(gateway, host, port))
