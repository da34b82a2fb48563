"""`agentrl` command line. Each command lives in its own module with `register(subparsers, common)`.

User mistakes (bad config, unknown env id, ...) print one line to stderr and exit 2, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from agentrl.config import ConfigError

# Modules under agentrl.cli that add commands, in the order `agentrl --help` lists them.
COMMAND_MODULES = ["train_cmd", "rollout_cmd", "config_cmd", "model_cmd", "envs_cmd", "tools_cmd", "export_cmd"]


class UsageError(Exception):
    """A user-facing mistake: printed as one line, exit code 2."""


def import_user_modules(modules: list[str] | None) -> None:
    """Import modules that register envs, tools or rewards (`--import pkg.mod`, or AGENTRL_IMPORTS=a,b)."""
    names = list(modules or []) + [m for m in os.environ.get("AGENTRL_IMPORTS", "").split(",") if m]
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise UsageError(f"--import {name}: {err}") from None


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--import",
        dest="imports",
        action="append",
        metavar="MODULE",
        help="import a module that registers envs/tools/rewards (repeatable)",
    )
    parser = argparse.ArgumentParser(
        prog="agentrl",
        description="Agentic multi-turn RL for LLMs: text envs + tools -> async rollout -> FSDP2 training.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(f"agentrl.cli.{name}").register(sub, common)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        import_user_modules(getattr(args, "imports", None))
        code = args.func(args)
    except (ConfigError, UsageError) as err:
        prefix = "config error" if isinstance(err, ConfigError) else "error"
        print(f"agentrl: {prefix}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("agentrl: interrupted", file=sys.stderr)
        return 130
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
