"""`agentrl serve-tools TOOLS.yaml --host 127.0.0.1 --port N [--token-env VAR]`: run a FastAPI tool server."""

from __future__ import annotations

import argparse

from agentrl.cli import UsageError
from agentrl.cli.server_args import add_bind_args, bearer_token


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("serve-tools", parents=[common], help="serve tools over HTTP (FastAPI + uvicorn)")
    p.add_argument("tools_file", metavar="TOOLS.yaml", help="a tools: section (sets -> name -> python: mod:fn)")
    add_bind_args(p, default_port=8808)
    p.add_argument("--max-concurrency", type=int, default=256, help="tool calls running at once")
    p.add_argument("--max-queue", type=int, default=1024, help="calls waiting for a slot before 503")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    p.add_argument("--max-sessions", type=int, default=10_000, help="open sessions before 429")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from agentrl.config.loader import resolve_config_path
    from agentrl.tools.serve import ServeError, check_bind, check_port, load_tools_file, serve
    from agentrl.tools.server import ServerLimits

    token = bearer_token(args)
    if not 0 < args.port < 65536:
        raise UsageError(f"--port {args.port}: must be 1-65535")
    for flag in ("max_concurrency", "max_queue", "max_body_bytes", "max_sessions"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1")
    try:
        check_bind(args.host, token)  # before loading tools: fail fast and cheap
        tools = load_tools_file(resolve_config_path(args.tools_file))
        check_port(args.host, args.port)  # in use: one line saying what to do, not uvicorn's log and exit 1
    except ServeError as err:
        raise UsageError(str(err)) from None
    limits = ServerLimits(
        max_concurrency=args.max_concurrency,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        max_sessions=args.max_sessions,
    )
    try:
        serve(tools, args.host, args.port, token=token, limits=limits)
    except OSError as err:  # port in use, address not available
        raise UsageError(f"cannot bind {args.host}:{args.port}: {err}") from None
    return 0
