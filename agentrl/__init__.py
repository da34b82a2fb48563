"""agentrl: agentic, multi-turn reinforcement learning of LLMs.

`register_env` / `make_env` are re-exported lazily from `agentrl.envs` so that `import agentrl` stays light.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {"register_env": "agentrl.envs", "make_env": "agentrl.envs"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'agentrl' has no attribute {name!r}")
