"""`agentrl config show CFG [overrides]`: print the resolved config as YAML."""

from __future__ import annotations

import argparse

from agentrl.config import dump_yaml, load_config


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("config", help="inspect a run config")
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    show = actions.add_parser("show", parents=[common], help="print the resolved config (YAML + overrides)")
    show.add_argument("config", help="YAML file")
    show.add_argument("overrides", nargs="*", help="dotted.key=value or +new.key=value")
    show.set_defaults(func=_show)


def _show(args: argparse.Namespace) -> int:
    print(dump_yaml(load_config(args.config, args.overrides)), end="")
    return 0
