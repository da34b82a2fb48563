"""The command-line reference, generated from the argument parsers (the docs site's `reference/cli.md`)."""

from __future__ import annotations

import argparse

from agentrl.cli import build_parser


def _commands(
    parser: argparse.ArgumentParser, prefix: str = "agentrl"
) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, help, parser) of every command and subcommand, in the order `--help` lists them."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                if name not in helps:  # an alias
                    continue
                out.append((f"{prefix} {name}", helps[name], sub))
                out += _commands(sub, f"{prefix} {name}")
    return out


def _row(action: argparse.Action) -> str:
    name = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.metavar or action.dest}`"
    default = action.default
    shown = "" if default in (None, argparse.SUPPRESS, False) or action.option_strings == [] else f"`{default}`"
    text = (action.help or "").replace("|", "\\|")
    if action.choices and not isinstance(action, argparse._SubParsersAction):
        text += f" (one of: {', '.join(map(str, action.choices))})"
    return f"| {name} | {shown} | {text} |"


def cli_reference() -> str:
    """Every `agentrl` command: what it does, its usage line and its arguments."""
    lines = [
        "# Command-line reference",
        "",
        "Generated from the argument parsers when the docs are built. Every command also takes `--verbose` (a user",
        "mistake prints its traceback above the one-line error) and `--import MODULE` (repeatable, or",
        "`AGENTRL_IMPORTS=a,b`: modules that register your envs, tools, rewards or agents).",
    ]
    for name, help_text, parser in _commands(build_parser()):
        usage = " ".join(parser.format_usage().split())
        lines += ["", f"## `{name}`", "", help_text[:1].upper() + help_text[1:] + ".", "", "```", usage, "```", ""]
        rows = [a for a in parser._actions if a.dest not in ("help", "verbose", "imports", "command")]
        rows = [a for a in rows if not isinstance(a, argparse._SubParsersAction)]
        if rows:
            lines += ["| argument | default | meaning |", "|---|---|---|", *(_row(a) for a in rows)]
    return "\n".join(lines) + "\n"
