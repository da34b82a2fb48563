"""The environment of a child process that runs Megatron-Core on the CPU: tests/megatron_cpu first on its
PYTHONPATH (its sitecustomize installs the test-only CUDA -> CPU shim when Megatron is imported), Ray's variables
of this pytest process left out (the child starts its own Ray, if any)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIM_DIR = ROOT / "tests" / "megatron_cpu"


def megatron_cpu_env(*paths: str | Path, **extra: str) -> dict[str, str]:
    """os.environ without RAY_*, PYTHONPATH = the shim, then `paths`, then the current one; plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    path = [str(SHIM_DIR), *map(str, paths), env.get("PYTHONPATH", "")]
    env.update(PYTHONPATH=os.pathsep.join(p for p in path if p), TOKENIZERS_PARALLELISM="false", **extra)
    return env
