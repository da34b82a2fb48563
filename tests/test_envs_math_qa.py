"""agentrl/MathTool-v0: check-env with a tool-using expert, the tool-call rule, answers, and reward scoring."""

from __future__ import annotations

import json
import random

import pytest

from agentrl.config.schema import RewardConfig, RewardFnSpec
from agentrl.envs import make_env
from agentrl.envs.checker import check_text_env
from agentrl.reward import Episode, RewardPool, combine
from agentrl.tools import ToolCall, parse_tool_calls
from agentrl.tools.calculator import evaluate


def test_check_env_expert_uses_tool_and_solves_all_random_fails() -> None:
    report = check_text_env("agentrl/MathTool-v0", episodes=30, seed=0)
    assert report["ok"], report["violations"]
    assert report["expert"]["success_rate"] == 1.0 and report["expert"]["tool_turns"] == 1.0
    assert report["random"]["success_rate"] <= 0.05


def test_problems_are_seeded_and_ground_truth_is_in_info() -> None:
    env = make_env("agentrl/MathTool-v0")
    obs, info = env.reset(seed=7)
    assert env.reset(seed=7)[0] == obs and env.reset(seed=8)[0] != obs
    task = info["task"]
    assert task["question"] == obs and str(evaluate(task["expression"])) == task["ground_truth"]
    assert int(task["ground_truth"]) > 0
    questions = {make_env("agentrl/MathTool-v0").reset(seed=s)[0].split()[1] for s in range(40)}
    assert len(questions) >= 3  # several templates in use


def test_expert_tool_call_then_answer_after_observe() -> None:
    env = make_env("agentrl/MathTool-v0")
    _, info = env.reset(seed=3)
    assert env.tools == ["calculator"] and "calculator" in env.system_prompt()
    calls = parse_tool_calls(env.expert_action())
    assert len(calls) == 1 and isinstance(calls[0], ToolCall) and calls[0].name == "calculator"
    result = str(evaluate(calls[0].arguments["expression"]))
    env.observe_tool_results([result])  # what the env manager does after running the call
    answer = env.expert_action()
    assert answer == f"<answer>{result}</answer>"
    obs, reward, terminated, truncated, step_info = env.step(answer)
    assert terminated and not truncated and reward == 1.0 and "correct" in obs
    assert step_info["metrics"]["success"] == 1.0 and step_info["metrics"]["tool_calls"] == 1.0
    assert step_info["task"] == info["task"]


def test_answers_boxed_wrong_and_malformed() -> None:
    env = make_env("agentrl/MathTool-v0")
    obs, info = env.reset(seed=5)
    truth = info["task"]["ground_truth"]
    call = json.dumps({"name": "calculator", "arguments": {"expression": "1+1"}})
    after, reward, terminated, _, step_info = env.step(f"<tool_call>{call}</tool_call>")  # not for step: no-op
    assert after == obs and not terminated and reward < 0 and step_info["metrics"]["action_is_valid"] == 0.0
    assert env.step(f"so the total is \\boxed{{{truth}}}")[1] == 1.0
    env.reset(seed=5)
    _, reward, terminated, _, step_info = env.step(f"<answer>{int(truth) + 1}</answer>")
    assert terminated and reward == 0.0 and step_info["metrics"]["success"] == 0.0
    env.reset(seed=5)
    for _ in range(env.max_steps - 1):
        assert not env.step("no idea")[3]
    assert env.step("no idea")[3]  # truncated after max_steps turns without an answer


def test_own_question_via_options() -> None:
    env = make_env("agentrl/MathTool-v0")
    obs, info = env.reset(seed=0, options={"question": "Capital of France?", "answer": "Paris"})
    assert obs == "Capital of France?" and info["task"]["ground_truth"] == "Paris"
    assert env.expert_action() == "<answer>Paris</answer>"
    assert env.step("<answer>paris</answer>")[1] == 1.0


def test_corpus_has_tool_calls_and_answers() -> None:
    corpus = make_env("agentrl/MathTool-v0").tokenizer_corpus(num_episodes=4, seed=0)
    assert any("<tool_call>" in t for t in corpus) and any("<tool_response>" in t for t in corpus)
    assert corpus == make_env("agentrl/MathTool-v0").tokenizer_corpus(num_episodes=4, seed=0)


async def test_math_env_episode_scored_by_reward_workers() -> None:
    """The path the env manager takes: play the episode, build an Episode, score it, combine with env return."""
    env = make_env("agentrl/MathTool-v0", correct_reward=0.0)
    obs, _info = env.reset(seed=11)
    messages = [{"role": "system", "content": env.system_prompt()}, {"role": "user", "content": obs}]
    call_text = env.expert_action()
    result = str(evaluate(parse_tool_calls(call_text)[0].arguments["expression"]))
    messages += [{"role": "assistant", "content": call_text}, {"role": "tool", "content": result}]
    env.observe_tool_results([result])
    answer = env.expert_action()
    _, env_reward, _, _, step_info = env.step(answer)
    messages.append({"role": "assistant", "content": answer})
    reward_cfg = RewardConfig(
        functions=[RewardFnSpec(name="math_verify"), RewardFnSpec(name="tool_call_format", weight=0.1)],
        env_reward_weight=0.0,
    )
    pool = RewardPool(reward_cfg, local=True)
    good = await pool.score(Episode(messages=messages, task=step_info["task"], env_id="agentrl/MathTool-v0"))
    assert good.components == {"math_verify": 1.0, "tool_call_format": 1.0}
    assert combine(env_reward, good, reward_cfg) == pytest.approx(1.1)
    wrong = [*messages[:-1], {"role": "assistant", "content": f"<answer>{random.randint(-9, -1)}</answer>"}]
    bad = await pool.score(Episode(messages=wrong, task=step_info["task"]))
    assert bad.components["math_verify"] == 0.0
    pool.shutdown()
