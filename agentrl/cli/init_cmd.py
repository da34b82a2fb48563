"""`agentrl init DIR [--package NAME]`: write a new project to start from: a registered text env with an expert
(for the warm start), a tool, a reward function, a config that trains on them with the built-in tiny model, a
README, and tests (`cd DIR && pytest -q` runs `agentrl check-env` and a 2-step train).

The files are package data under agentrl/templates/project (see agentrl.templates).
"""

from __future__ import annotations

import argparse
import importlib.util
import keyword
import re
import sys
from importlib import resources
from pathlib import Path

from agentrl.cli import UsageError

SUFFIX = ".tmpl"


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "init", parents=[common], help="write a new project: env, tool, reward, config, tests (never overwrites)"
    )
    p.add_argument("dir", metavar="DIR", help="the project folder to create (or an empty one)")
    p.add_argument("--package", metavar="NAME", help="the project's Python package name (default: from DIR's name)")
    p.set_defaults(func=_init)


def package_name(folder: Path) -> str:
    """A Python package name from a folder name: lower case, `-`, `.` and spaces as `_`."""
    name = re.sub(r"\W", "_", folder.resolve().name.lower().replace("-", "_")).strip("_") or "project"
    return f"p_{name}" if name[0].isdigit() else name


def _taken(package: str) -> bool:
    """An importable module of that name (a plain folder of that name, such as DIR itself, does not count)."""
    if package in sys.builtin_module_names or package in sys.stdlib_module_names:
        return True
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin not in (None, "namespace")


def _template_files() -> list[tuple[str, str]]:
    """(path relative to the project, template text) for every file of the project template."""
    root = resources.files("agentrl.templates") / "project"
    found: list[tuple[str, str]] = []

    def walk(node, rel: str) -> None:
        for child in sorted(node.iterdir(), key=lambda c: c.name):
            path = f"{rel}/{child.name}" if rel else child.name
            if child.is_dir():
                if child.name != "__pycache__":
                    walk(child, path)
            elif child.name.endswith(SUFFIX):
                name = child.name[: -len(SUFFIX)]
                name = "." + name[len("dot_") :] if name.startswith("dot_") else name  # setuptools skips dotfiles
                found.append((f"{rel}/{name}" if rel else name, child.read_text()))

    walk(root, "")
    return found


def _init(args: argparse.Namespace) -> int:
    folder = Path(args.dir)
    package = args.package or package_name(folder)
    if not package.isidentifier() or keyword.iskeyword(package):
        raise UsageError(f"--package {package!r}: not a valid Python package name (e.g. my_project)")
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{folder}: exists and is not a directory")
    files = _template_files()
    if not files:
        raise UsageError("the project template is missing (reinstall agentrl: pip install -e .)")
    values = {"{{package}}": package, "{{name}}": folder.resolve().name}
    planned: list[tuple[Path, str]] = []
    for rel, text in files:
        rel = rel.replace("package/", f"{package}/", 1) if rel.startswith("package/") else rel
        for key, value in values.items():
            text = text.replace(key, value)
        planned.append((folder / rel, text))
    clash = [str(path) for path, _ in planned if path.exists()]
    if clash:
        raise UsageError(f"{', '.join(clash)} already exist(s); not overwriting (pick a new or empty DIR)")
    if _taken(package):
        raise UsageError(
            f"package name {package!r} is taken by an installed module, which it would shadow or be shadowed by: "
            "pass --package NAME with another name"
        )
    for path, text in planned:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    print(f"wrote {len(planned)} files to {folder}/ ({package}: env, tool, reward; config.yaml; tests)")
    print(f"next: cd {folder} && pytest -q   then: agentrl train config.yaml --import {package}")
    return 0
