"""Packaging: envs/, tools/, reward/, examples/ install under the agentrl namespace only, in a real (non-editable)
install; the example configs ship as package data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from tests.conftest import wheel_env

ROOT = Path(__file__).parents[1]
WIDTH = 72  # the $COLUMNS the card command's run gets
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


def test_wheel_install_maps_namespaces(tmp_path, wheel_site):
    target = wheel_site
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


@pytest.mark.slow
def test_the_card_command_runs_from_a_wheel_install_in_an_empty_directory(tmp_path, wheel_site):
    """A user who pip-installed agentrl types the product's own command in an empty folder: the bare example
    name resolves to the packaged config, and a short run trains and reports held-out success before and after.
    Its console is not a terminal here: plain lines, none wider than $COLUMNS (tests/test_console.py checks the
    live view in a terminal)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    cmd = [sys.executable, "-m", "agentrl", "train", "agentic_sokoban.yaml", "trainer.total_steps=2",
           "trainer.sft.steps=10", "validation.episodes_per_tag=8", "trainer.sft.episodes=200",
           "envs.train.sokoban.groups_per_batch=4", "checkpoint.every_steps=0"]  # fmt: skip
    env = {**wheel_env(wheel_site), "COLUMNS": str(WIDTH)}
    env = {k: v for k, v in env.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "LINES")}
    res = subprocess.run(cmd, cwd=empty, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    example = str(wheel_site / "agentrl" / "examples" / "agentic_sokoban.yaml")
    # every line fits, but the one announcing the resolved config: a path is printed whole, or it is no use
    lines = [line for line in (res.stdout + res.stderr).splitlines() if example not in line]
    styled = [line for line in lines if "\x1b[" in line or "━" in line]
    assert not styled, styled  # plain lines in a log
    assert all(len(line) <= WIDTH for line in lines), [line for line in lines if len(line) > WIDTH]
    for words in ("started Ray", "warm start: SFT", "demo samples", "validation at step 0: success", "step 1/2  ETA",
                  "step 2/2", "validation at step 2: success", "best step", "resume"):  # fmt: skip
        assert any(words in line for line in lines), words
    assert not any("Token authentication" in line for line in lines)  # Ray's notices only with --verbose
    assert f"using the packaged example {example}" in res.stderr
    assert "held-out success" in res.stdout
    runs = list((empty / "runs").glob("*/metrics.jsonl"))
    assert len(runs) == 1 and sorted(empty.iterdir()) == [empty / "runs"], "the run writes only under runs/"
    rows = [json.loads(line) for line in runs[0].read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2]
    assert sum("val/success" in r for r in rows) == 2
