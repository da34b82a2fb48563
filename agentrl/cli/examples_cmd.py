"""`agentrl examples [list]`: the packaged example configs, one line each; `agentrl examples copy NAME [DIR]`.

Every command that takes a config file also takes a bare example name (`agentrl train agentic_sokoban.yaml`)
when no such file exists in the working directory: see agentrl.config.loader.resolve_config_path.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from agentrl.cli import UsageError
from agentrl.config.loader import packaged_examples


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("examples", help="list the packaged example configs, or copy one out for editing")
    p.set_defaults(func=_list)
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    listing = actions.add_parser("list", help="one line per example: name and description (the default)")
    listing.set_defaults(func=_list)
    copy = actions.add_parser("copy", help="write NAME.yaml into DIR (default: here); never overwrites")
    copy.add_argument("name", metavar="NAME", help="an example name, with or without .yaml")
    copy.add_argument("dir", metavar="DIR", nargs="?", default=".", help="destination folder (created if missing)")
    copy.set_defaults(func=_copy)


def _description(path: Path) -> str:
    """The example's first comment line, without the `#`."""
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
    return ""


def _list(args: argparse.Namespace) -> int:
    examples = packaged_examples()
    if not examples:
        raise UsageError("no packaged examples found (reinstall agentrl: pip install -e .)")
    width = max(len(name) for name in examples)
    for name, path in examples.items():
        print(f"{name:<{width}}  {_description(path)}")
    return 0


def _copy(args: argparse.Namespace) -> int:
    examples = packaged_examples()
    name = args.name[: -len(".yaml")] if args.name.endswith(".yaml") else args.name
    if name not in examples:
        raise UsageError(f"no packaged example {args.name!r} (packaged examples: {', '.join(examples) or 'none'})")
    folder = Path(args.dir)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{folder}: not a directory")
    target = folder / f"{name}.yaml"
    if target.exists():
        raise UsageError(f"{target} already exists; not overwriting it (remove it or pick another DIR)")
    folder.mkdir(parents=True, exist_ok=True)
    try:
        with target.open("xb") as out:
            out.write(examples[name].read_bytes())
    except FileExistsError:
        raise UsageError(f"{target} already exists; not overwriting it (remove it or pick another DIR)") from None
    print(target)
    return 0
