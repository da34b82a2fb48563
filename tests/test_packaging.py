"""Packaging: envs/, tools/, reward/, examples/ install under the agentrl namespace only, in a real (non-editable)
install; the example configs ship as package data."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).parents[1]
MAPPING = {
    "agentrl": "agentrl",
    "agentrl.envs": "envs",
    "agentrl.tools": "tools",
    "agentrl.reward": "reward",
    "agentrl.examples": "examples",
}


def _package_folders() -> set[str]:
    found = set()
    for prefix, folder in MAPPING.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            if "__pycache__" in rel.parts:
                continue
            found.add(".".join([prefix, *rel.parts]) if rel.parts else prefix)
    return found


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    missing = _package_folders() - listed
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"


def test_wheel_install_maps_namespaces(tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert (target / "agentrl" / "envs" / "__init__.py").exists()
    assert not (target / "envs").exists() and not (target / "tools").exists()
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}
    code = "import agentrl, agentrl.envs, agentrl.tools, agentrl.reward; print(agentrl.__file__)"
    ok = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip().startswith(str(target))
    code = "from agentrl.config.loader import packaged_examples; print(*packaged_examples().values(), sep=chr(10))"
    found = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert found.returncode == 0, found.stderr
    shipped = sorted(Path(line) for line in found.stdout.splitlines())
    assert [p.name for p in shipped] == sorted(p.name for p in (ROOT / "examples").glob("*.yaml"))
    assert all(p.is_relative_to(target / "agentrl" / "examples") for p in shipped), shipped
    for name in ("envs", "tools", "reward", "examples"):
        bad = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=tmp_path, env=env, capture_output=True)
        assert bad.returncode != 0, f"`import {name}` must not work"
