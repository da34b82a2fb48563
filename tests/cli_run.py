"""Run the `agentrl` CLI as a user would (a subprocess) and check its one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def agentrl(*args: str, cwd: Path = ROOT, env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess:
    """`env`: variables to set in the child on top of this process's (None: unset); os.environ stays as it is."""
    child = None
    if env is not None:
        child = {**os.environ, **{k: v for k, v in env.items() if v is not None}}
        for name in (k for k, v in env.items() if v is None):
            child.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "agentrl", *args], cwd=cwd, env=child, capture_output=True, text=True, timeout=120
    )


def assert_one_line_error(res: subprocess.CompletedProcess, *words: str) -> None:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    for word in words:
        assert word in lines[0], lines[0]
