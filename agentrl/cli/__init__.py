"""`agentrl` command line. Each command lives in its own module with `register(subparsers, common)`.

User mistakes (bad config, unknown env id, ...) print one line to stderr and exit 2, without a traceback
(`--verbose`, anywhere on the command line, prints the traceback above that line).
Options may come anywhere after the command (`agentrl train cfg.yaml --import mod a.b=1`), and are never
abbreviated (`--token` is not taken for `--token-env`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

from agentrl.config import ConfigError
from agentrl.plugins import UserImportError
from agentrl.plugins import import_user_modules as _import_user_modules

# Modules under agentrl.cli that add commands, in the order `agentrl --help` lists them.
COMMAND_MODULES = [
    "train_cmd",
    "plan_cmd",
    "rollout_cmd",
    "config_cmd",
    "model_cmd",
    "envs_cmd",
    "tools_cmd",
    "serve_envs_cmd",
    "export_cmd",
    "view_cmd",
    "examples_cmd",
    "init_cmd",
]


class UsageError(Exception):
    """A user-facing mistake: printed as one line, exit code 2."""


def import_user_modules(modules: list[str] | None) -> None:
    """Import modules that register envs, tools or rewards (`--import pkg.mod`, or AGENTRL_IMPORTS=a,b)."""
    try:
        _import_user_modules(modules)
    except UserImportError as err:
        raise UsageError(str(err)) from None


class Parser(argparse.ArgumentParser):
    """No abbreviated options; a command's options and positionals may be intermixed; errors are one line."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)
        self._intermixing = False

    def parse_known_args(self, args=None, namespace=None):
        # A parser with subcommands cannot intermix (argparse's rule); parse_known_intermixed_args calls back
        # here for its two passes, which must be the plain parse.
        if self._subparsers is not None or self._intermixing:
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    common = Parser(add_help=False)
    common.add_argument(
        "--import",
        dest="imports",
        action="append",
        metavar="MODULE",
        help="import a module that registers envs/tools/rewards (repeatable; also AGENTRL_IMPORTS=a,b)",
    )
    parser = Parser(
        prog="agentrl",
        description="Agentic multi-turn RL for LLMs: text envs + tools -> async rollout -> FSDP2 training.",
    )
    _add_verbose(common)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(f"agentrl.cli.{name}").register(sub, common)
    _add_verbose(parser)
    return parser


def _add_verbose(parser: argparse.ArgumentParser) -> None:
    """`--verbose` on `parser` and every (sub)command under it that lacks it, so that it is taken before or after
    any command. SUPPRESS: a subcommand's default would otherwise overwrite a leading `agentrl --verbose CMD`;
    main() sets args.verbose either way."""
    if "--verbose" not in parser._option_string_actions:
        parser.add_argument(
            "--verbose",
            action="store_true",
            default=argparse.SUPPRESS,
            help="on a user mistake, print the traceback too (not only the one-line error)",
        )
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                _add_verbose(child)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.verbose = bool(getattr(args, "verbose", False))
    try:
        import_user_modules(getattr(args, "imports", None))
        code = args.func(args)
    except (ConfigError, UsageError) as err:
        if args.verbose:
            err.__suppress_context__ = False  # `raise ... from None` hid the underlying error: show it here
            traceback.print_exc()
        prefix = "config error" if isinstance(err, ConfigError) else "error"
        print(f"agentrl: {prefix}: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("agentrl: interrupted", file=sys.stderr)
        return 130
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
