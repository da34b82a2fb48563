"""The bind and auth flags every `agentrl serve-*` command shares, and the token they name."""

from __future__ import annotations

import argparse
import os

from agentrl.cli import UsageError


def add_bind_args(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--host", default="127.0.0.1", help="bind address; non-loopback needs --token-env")
    p.add_argument("--port", type=int, default=default_port, help="TCP port")
    p.add_argument("--token-env", metavar="VAR", help="environment variable holding the bearer token")


def bearer_token(args: argparse.Namespace) -> str | None:
    """The token in $VAR of --token-env VAR (read from the environment, never from the command line)."""
    if not args.token_env:
        return None
    token = os.environ.get(args.token_env)
    if not token:
        raise UsageError(f"--token-env {args.token_env}: the variable is not set or empty")
    return token
