"""Packaged example configs: a bare name resolves to them (a local file wins), `agentrl examples` lists them,
`agentrl examples copy` writes one out, and a built wheel carries them.

The CLI runs as a subprocess from a temporary working directory outside the repository.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import yaml

from tests.cli_run import agentrl, assert_one_line_error

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.yaml"))


def test_bare_name_resolves_to_the_packaged_example(tmp_path):
    for arg in ("agentic_sokoban.yaml", "agentic_sokoban"):
        res = agentrl("config", "show", arg, cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("agentrl: using the packaged example "), res.stderr
        used = Path(lines[0].removeprefix("agentrl: using the packaged example "))
        assert used.name == "agentic_sokoban.yaml" and used.is_file()
        assert used.read_bytes() == (ROOT / "examples" / "agentic_sokoban.yaml").read_bytes()
        assert yaml.safe_load(res.stdout)["name"] == "agentic_sokoban"


def test_a_local_file_of_the_same_name_wins(tmp_path):
    (tmp_path / "agentic_sokoban.yaml").write_text("name: mine\n")
    res = agentrl("config", "show", "agentic_sokoban.yaml", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "packaged example" not in res.stderr
    assert yaml.safe_load(res.stdout)["name"] == "mine"


def test_a_path_with_a_directory_part_is_never_resolved(tmp_path):
    res = agentrl("config", "show", "sub/agentic_sokoban.yaml", cwd=tmp_path)
    assert_one_line_error(res, "config file not found", "sub/agentic_sokoban.yaml")


def test_unknown_name_lists_the_examples(tmp_path):
    res = agentrl("config", "show", "no_such_example.yaml", cwd=tmp_path)
    assert_one_line_error(res, "config file not found: no_such_example.yaml", *EXAMPLES)


def test_examples_lists_every_yaml_with_its_description(tmp_path):
    res = agentrl("examples", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert [line.split()[0] for line in lines] == EXAMPLES
    for name, line in zip(EXAMPLES, lines, strict=True):
        first = (ROOT / "examples" / f"{name}.yaml").read_text().splitlines()[0]
        assert first.startswith("# "), f"examples/{name}.yaml: the first line must be a `# description`"
        assert line.endswith(first.removeprefix("# ").strip())
    assert agentrl("examples", "list", cwd=tmp_path).stdout == res.stdout


def test_examples_copy_writes_an_identical_file_and_never_overwrites(tmp_path):
    res = agentrl("examples", "copy", "sokoban_sync", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    copied = tmp_path / "sokoban_sync.yaml"
    assert copied.read_bytes() == (ROOT / "examples" / "sokoban_sync.yaml").read_bytes()

    res = agentrl("examples", "copy", "tools.yaml", "out/dir", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "out" / "dir" / "tools.yaml").read_bytes() == (ROOT / "examples" / "tools.yaml").read_bytes()

    copied.write_text("name: edited\n")
    res = agentrl("examples", "copy", "sokoban_sync", cwd=tmp_path)
    assert_one_line_error(res, "already exists")
    assert copied.read_text() == "name: edited\n"

    res = agentrl("examples", "copy", "no_such_example", cwd=tmp_path)
    assert_one_line_error(res, "no_such_example", *EXAMPLES)


def test_the_wheel_ships_the_examples(tmp_path):
    out = tmp_path / "wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = out.glob("agentrl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"agentrl/examples/{name}.yaml" for name in EXAMPLES} <= names
    assert "agentrl/examples/__init__.py" in names
    assert not any(name.startswith("examples/") for name in names)
