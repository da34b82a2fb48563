"""`agentrl envs` and `agentrl check-env`, run as subprocesses like a user would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def agentrl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "agentrl", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_envs_lists_builtin_and_imported_envs_with_defaults() -> None:
    out = agentrl("envs", "--import", "tests.envs_fixtures", "--json")
    assert out.returncode == 0, out.stderr
    table = json.loads(out.stdout)
    for env_id in ("agentrl/SimpleSokoban-v0", "agentrl/LargerSokoban-v0", "agentrl/FrozenLake-v0",
                   "agentrl/GuessNumber-v0", "agentrl/GymFrozenLakeText-v0", "tests/CountTo-v0"):  # fmt: skip
        assert env_id in table
    assert table["tests/CountTo-v0"]["target"] == 3
    assert table["tests/CountTo-v0"]["max_steps"] == 6
    assert table["agentrl/LargerSokoban-v0"]["num_boxes"] == 2
    assert table["agentrl/SimpleSokoban-v0"]["max_steps"] == 15
    text = agentrl("envs", "--import", "tests.envs_fixtures")
    assert "tests/CountTo-v0" in text.stdout and "target=3" in text.stdout


def test_check_env_passes_an_env_from_a_test_module() -> None:
    out = agentrl("check-env", "tests/CountTo-v0", "target=4", "--import", "tests.envs_fixtures", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    # options may also come between the positionals
    same = agentrl("check-env", "tests/CountTo-v0", "--import", "tests.envs_fixtures", "target=4", "--json")
    assert same.returncode == 0 and json.loads(same.stdout)["expert"]["mean_turns"] == 4.0, same.stderr
    report = json.loads(out.stdout)
    assert report["ok"] and report["violations"] == []
    assert report["expert"]["success_rate"] == 1.0
    assert report["expert"]["mean_turns"] == 4.0
    assert 0.0 <= report["random"]["success_rate"] < 1.0
    assert report["random"]["steps_per_s"] > 0 and report["random"]["reset_ms"] >= 0


def test_check_env_reports_random_and_expert_for_sokoban() -> None:
    out = agentrl("check-env", "agentrl/SimpleSokoban-v0", "--episodes", "10")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OK" in out.stdout and "random" in out.stdout and "expert  success 100.0%" in out.stdout
    assert "steps/s" in out.stdout and "reset" in out.stdout


def test_check_env_fails_on_a_contract_violation() -> None:
    out = agentrl("check-env", "tests/NoMetrics-v0", "--import", "tests.envs_fixtures")
    assert out.returncode == 1
    assert "FAIL tests/NoMetrics-v0" in out.stderr and "metrics" in out.stderr


def test_check_env_usage_errors_exit_2_with_one_line() -> None:
    unknown = agentrl("check-env", "agentrl/NoSuchEnv-v0")
    assert unknown.returncode == 2 and "unknown env id" in unknown.stderr
    assert len(unknown.stderr.strip().splitlines()) == 1
    bad_kwarg = agentrl("check-env", "agentrl/SimpleSokoban-v0", "colour=red")
    assert bad_kwarg.returncode == 2 and "colour" in bad_kwarg.stderr
    bad_value = agentrl("check-env", "agentrl/SimpleSokoban-v0", "symbols=abc")
    assert bad_value.returncode == 2 and "symbols" in bad_value.stderr
    missing = agentrl("envs", "--import", "tests.no_such_module")
    assert missing.returncode == 2


def test_check_env_plays_an_agent_program_with_the_expert_answering() -> None:
    agent = "agentrl.examples.sokoban_openai_agent:agent"
    out = agentrl("check-env", "agentrl/SimpleSokoban-v0", "--agent", agent, "--episodes", "4", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["ok"] and report["success_rate"] == 1.0 and report["failed"] == 0 and report["mean_turns"] >= 1
    bad = agentrl("check-env", "agentrl/SimpleSokoban-v0", "--agent", "tests.agents_fixtures:scored", "--episodes", "2")
    assert bad.returncode == 1 and "no expert_reply" in bad.stderr
    missing = agentrl("check-env", "agentrl/SimpleSokoban-v0", "--agent", "tests.no_such_module:agent")
    assert missing.returncode == 2 and "cannot import agent" in missing.stderr
