"""Makes this process lack what the offline GPU node lacks: in any process with this folder on PYTHONPATH, an
import of one of agentrl's dependencies (core and every extra) that is neither on the node
(`scripts/gpu_node/packages.txt`) nor among the wheels carried to it (`scripts/gpu_node/wheels.txt`) fails with
ModuleNotFoundError, as it would there: ray, vllm, sglang, flash_attn, fastapi, gymnasium and the rest.

Packages the node has keep their own dependencies there (its huggingface_hub is not ours), so only agentrl's own
dependencies are refused; `importlib.util.find_spec` (how libraries probe for optional packages) finds them absent.
Every import of a third-party package the node lacks is appended to the file
$AGENTRL_NODE_IMPORTS names, if set ("refused NAME", or "absent NAME" for another package's dependency that the
node may import differently), so a test can show what the hook saw.
Chains to any other sitecustomize further down sys.path.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import re
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_NODE = os.path.join(_HERE, "..", "..", "scripts", "gpu_node")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _listed(path: str) -> set[str]:
    names = set()
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                names.add(_norm(re.split(r"[=<>!~ \[]", line, maxsplit=1)[0]))
    return names


ON_NODE = _listed(os.path.join(_NODE, "packages.txt")) | _listed(os.path.join(_NODE, "wheels.txt")) | {"agentrl"}


def _agentrl_dependencies() -> set[str]:
    """Normalised names of every distribution agentrl requires, core and every extra."""
    try:
        requires = importlib.metadata.requires("agentrl") or []
    except importlib.metadata.PackageNotFoundError:
        return set()
    return {_norm(re.split(r"[=<>!~ ;\[(]", r, maxsplit=1)[0]) for r in requires}


REFUSED = _agentrl_dependencies() - ON_NODE


class _NodeImports(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self._owners: dict[str, list[str]] | None = None
        self._seen: set[str] = set()

    def _distributions(self, top: str) -> list[str]:
        if self._owners is None:
            self._owners = importlib.metadata.packages_distributions()
        return self._owners.get(top, [])

    def refuses(self, top: str) -> bool:
        owners = {_norm(d) for d in self._distributions(top)}
        return bool(owners) and not owners & ON_NODE and bool(owners & REFUSED)

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.partition(".")[0]
        if path is not None or top in sys.stdlib_module_names or top in sys.builtin_module_names:
            return None  # submodules were vetted with their top-level package
        owners = {_norm(d) for d in self._distributions(top)}
        if not owners or owners & ON_NODE:  # not installed here (flash_attn, sglang): absent anyway
            return None
        refused = bool(owners & REFUSED)
        if top not in self._seen:
            self._seen.add(top)
            log = os.environ.get("AGENTRL_NODE_IMPORTS")
            if log:
                with open(log, "a") as f:
                    f.write(f"{'refused' if refused else 'absent'} {top}\n")
        if refused:
            raise ModuleNotFoundError(f"No module named {top!r} (not on the GPU node: scripts/gpu_node/)", name=top)
        return None


if not any(type(f).__name__ == "_NodeImports" for f in sys.meta_path):  # once, however sitecustomizes chain
    _FINDER = _NodeImports()
    sys.meta_path.insert(0, _FINDER)
    _real_find_spec = importlib.util.find_spec

    def _find_spec(name, package=None):
        """An availability probe (accelerate's `is_wandb_available`, transformers' `is_peft_available`) finds a
        refused package absent, as on the node, where only importing it would fail."""
        if not name.startswith(".") and _FINDER.refuses(name.partition(".")[0]) and name not in sys.modules:
            return None
        return _real_find_spec(name, package)

    importlib.util.find_spec = _find_spec

# Chain to a sitecustomize further down the path (this one shadows it).
_after = [os.path.abspath(p or ".") for p in sys.path]
_rest = _after[_after.index(_HERE) + 1 :] if _HERE in _after else []
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.origin and os.path.dirname(os.path.abspath(_spec.origin)) != _HERE:
    _mod = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)
