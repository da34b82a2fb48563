"""`agentrl init DIR` writes a project whose own tests pass: `agentrl init myproj && cd myproj && pytest -q` runs
`agentrl check-env` on its env and a 2-step train (warm start + RL) with its env, tool and reward."""

from __future__ import annotations

import fnmatch
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from tests.cli_run import ROOT, agentrl, assert_one_line_error
from tests.conftest import wheel_env

TEMPLATE = ROOT / "agentrl" / "templates" / "project"
LAYOUT = [
    ".gitignore",
    "README.md",
    "config.yaml",
    "myproj/__init__.py",
    "myproj/env.py",
    "myproj/rewards.py",
    "myproj/tools.py",
    "pyproject.toml",
    "tests/test_project.py",
]


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


@pytest.mark.slow
def test_init_writes_a_project_whose_tests_pass(tmp_path: Path, wheel_site: Path) -> None:
    """As a user who pip-installed agentrl (a wheel, not this checkout) would: init, then the project's tests."""
    env = wheel_env(wheel_site)
    res = agentrl("init", "myproj", cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    project = tmp_path / "myproj"
    assert _files(project) == LAYOUT
    assert "{{" not in "".join((project / f).read_text() for f in LAYOUT)
    assert "pytest -q" in res.stdout and "--import myproj" in res.stdout
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    assert "2 passed" in tests.stdout, tests.stdout


def test_init_never_overwrites_and_checks_the_package_name(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "config.yaml").write_text("name: mine\n")
    assert_one_line_error(agentrl("init", "taken", cwd=tmp_path), "taken/config.yaml", "not overwriting")
    assert _files(tmp_path / "taken") == ["config.yaml"]  # nothing written when anything clashes
    assert (tmp_path / "taken" / "config.yaml").read_text() == "name: mine\n"
    assert_one_line_error(agentrl("init", "x", "--package", "my-pkg", cwd=tmp_path), "--package", "my-pkg")
    assert_one_line_error(agentrl("init", "json", cwd=tmp_path), "'json' is taken", "--package NAME")
    assert not (tmp_path / "x").exists() and not (tmp_path / "json").exists()
    res = agentrl("init", "My-Project.v2", cwd=tmp_path)  # a folder name that is no identifier
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "My-Project.v2" / "my_project_v2" / "env.py").is_file()
    config = (tmp_path / "My-Project.v2" / "config.yaml").read_text()
    assert "name: My-Project.v2" in config and "--import my_project_v2" in config


def test_every_template_file_ships_as_package_data() -> None:
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "agentrl.templates" in tool["packages"]
    patterns = tool["package-data"]["agentrl.templates"]
    files = [str(p.relative_to(TEMPLATE.parent)) for p in TEMPLATE.rglob("*") if p.is_file()]
    files = [f for f in files if "__pycache__" not in f]
    assert files and all(f.endswith(".tmpl") for f in files)
    # fnmatch's * also crosses "/", so match segment by segment as setuptools' glob does
    missing = [f for f in files if not any(fnmatch.fnmatch(f, p) and f.count("/") == p.count("/") for p in patterns)]
    assert not missing, f"add to [tool.setuptools.package-data] agentrl.templates: {missing}"
