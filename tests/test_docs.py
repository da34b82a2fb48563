"""The documentation: the site builds with `mkdocs build --strict` (a broken link, anchor or API reference fails
it), its config reference covers every config key, the README's commands exist, and the getting-started page's
code works as a new user would run it (the env it writes passes check-env and trains)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.cli import build_parser
from agentrl.cli.reference import cli_reference
from agentrl.config.reference import _section_doc, config_keys, config_reference
from tests.shared_runs import getting_started_files, strip_ansi

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def test_the_site_builds_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    config_page = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    assert "trainer.algorithm.clip_high" in config_page and "logging.sample_every_steps" in config_page
    assert "agentrl view" in (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    assert "TextEnv" in (tmp_path / "site" / "reference" / "api" / "index.html").read_text()


def test_every_config_key_is_in_the_generated_reference_with_a_description():
    reference = config_reference()
    keys = list(config_keys())
    assert len(keys) > 150
    for key, field in keys:
        assert f"| `{key}` |" in reference, key
        assert field.description or _section_doc(field.annotation), f"{key} has no description"


def test_every_command_is_in_the_cli_reference():
    reference = cli_reference()
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name in sub.choices:
        assert f"## `agentrl {name}`" in reference, name


def test_the_readme_and_docs_name_only_commands_and_targets_that_exist():
    commands = set(next(a for a in build_parser()._actions if a.dest == "command").choices)
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    texts = {p: p.read_text() for p in [ROOT / "README.md", *DOCS.rglob("*.md")]}
    for path, text in texts.items():
        for code in re.findall(r"`([^`\n]+)`|```(?:bash)?\n(.*?)```", text, re.S):
            for snippet in filter(None, code):
                for cmd in re.findall(r"(?:^|[\s(])agentrl ([a-z][\w-]*)", snippet):
                    assert cmd in commands, f"{path.name}: agentrl {cmd}"
                for target in re.findall(r"(?:^|[\s(])make ([a-z][\w-]*)", snippet):
                    assert target in targets, f"{path.name}: make {target}"
    for path in re.findall(r"\]\(((?:docs|examples)/[^)#]+)", texts[ROOT / "README.md"]):
        assert (ROOT / path).exists(), f"README links {path}"
    assert len(texts[ROOT / "README.md"].splitlines()) <= 200


@pytest.mark.slow
@pytest.mark.heavy
def test_the_getting_started_page_works_as_written(getting_started_run):
    """The page's files, written out as a user would, pass check-env and train (shortened: 2 RL steps) in a
    terminal (tests/shared_runs.py)."""
    folder, code, shown = getting_started_run
    assert [name for name, _ in getting_started_files()] == ["walk_env.py", "walk.yaml"]
    check = subprocess.run([sys.executable, "-m", "agentrl", "check-env", "walk/NumberWalk-v0", "--import", "walk_env"],
                           cwd=folder, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert check.returncode == 0 and "walk/NumberWalk-v0: OK" in check.stdout, check.stdout + check.stderr
    assert "expert  success 100.0%" in check.stdout
    assert code == 0, shown[-3000:]
    run = folder / "runs" / "walk"
    assert "held-out success" in strip_ansi(shown) and (run / "checkpoints").is_dir()
    assert sorted(p.name for p in (run / "episodes").iterdir())[-1] == "step-000002.jsonl"
