"""FrozenLake, GuessNumber, the gymnasium adapter, the answer parser, the registry and tokenizer corpora."""

from __future__ import annotations

import random
import time
import warnings

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import agentrl
from agentrl.envs import AnswerParser, GymTextAdapter, TextEnv, UnknownEnvError, registered_env_ids

BUILTIN = [
    "agentrl/Sokoban-v0",
    "agentrl/SimpleSokoban-v0",
    "agentrl/LargerSokoban-v0",
    "agentrl/FrozenLake-v0",
    "agentrl/GuessNumber-v0",
    "agentrl/GymFrozenLakeText-v0",
]


def run_expert(env: TextEnv, seed: int) -> tuple[float, int]:
    env.reset(seed=seed)
    terminated = truncated = False
    while not (terminated or truncated):
        _, _, terminated, truncated, info = env.step(env.expert_action())
    return info["metrics"]["success"], env.turns


def test_builtin_envs_are_registered_and_pass_gymnasium_checker() -> None:
    assert set(BUILTIN) <= set(registered_env_ids())
    for env_id in BUILTIN:
        env = gym.make(env_id)  # gymnasium's own make works too
        assert isinstance(env.unwrapped, TextEnv)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a checker warning is a failure here
            check_env(env.unwrapped)
        assert agentrl.make_env(env_id).system_prompt().count("\n") <= 3  # a few lines: tiny models read it


def test_unknown_env_id_names_the_known_ones() -> None:
    with pytest.raises(UnknownEnvError, match="SimpleSokoban"):
        agentrl.make_env("agentrl/Nope-v0")


def test_register_env_is_idempotent_and_make_env_rejects_non_text_envs() -> None:
    agentrl.register_env("tests/Plain-v0", "gymnasium.envs.toy_text.frozen_lake:FrozenLakeEnv")
    agentrl.register_env("tests/Plain-v0", "gymnasium.envs.toy_text.frozen_lake:FrozenLakeEnv")
    assert registered_env_ids().count("tests/Plain-v0") == 1
    with pytest.raises(TypeError, match="GymTextAdapter"):
        agentrl.make_env("tests/Plain-v0")


def test_frozen_lake_maps_are_solvable_and_the_expert_wins() -> None:
    env = agentrl.make_env("agentrl/FrozenLake-v0")
    maps = set()
    for seed in range(100):
        obs, _ = env.reset(seed=seed)
        maps.add(obs)
        assert obs.count("P") == 1 and obs.count("G") == 1 and len(obs.splitlines()) == 4
        assert run_expert(env, seed)[0] == 1.0
    assert len(maps) > 90


def test_frozen_lake_hole_edge_and_goal() -> None:
    env = agentrl.make_env("agentrl/FrozenLake-v0", size=2, p_frozen=1.0)
    obs, _ = env.reset(seed=0)
    row, col = next((r, line.index("P")) for r, line in enumerate(obs.splitlines()) if "P" in line)
    off_board = "Up" if row == 0 else "Down"
    *_, info = env.step(f"<answer>{off_board}</answer>")
    assert info["metrics"]["action_is_effective"] == 0.0
    env._grid = [["H", "H"], ["H", "H"]]  # every neighbour is a hole
    env._grid[row][col] = "S"
    _, reward, terminated, _, info = env.step("<answer>left</answer>" if col == 1 else "<answer>right</answer>")
    assert terminated and reward == 0.0 and info["metrics"]["success"] == 0.0


def test_slippery_frozen_lake_is_reproducible_per_seed() -> None:
    def trajectory(seed: int) -> list[str]:
        env = agentrl.make_env("agentrl/FrozenLake-v0", is_slippery=True, size=6)
        env.reset(seed=seed)
        return [env.step("<answer>Down</answer>")[0] for _ in range(6)]

    assert trajectory(3) == trajectory(3)


def test_guess_number_needs_several_turns_and_bisection_wins() -> None:
    env = agentrl.make_env("agentrl/GuessNumber-v0", max_number=100, max_steps=7)
    for seed in range(50):
        success, turns = run_expert(env, seed)
        assert success == 1.0 and turns <= 7
    env.reset(seed=1)
    secret = env._secret
    obs, _, _, _, info = env.step(f"<answer>{100 if secret < 100 else 1}</answer>")
    assert ("too high" in obs or "too low" in obs) and info["metrics"]["action_is_effective"] == 1.0
    _, _, _, _, info = env.step(f"<answer>{100 if secret < 100 else 1}</answer>")  # same guess again
    assert info["metrics"]["action_is_effective"] == 0.0  # gathers nothing new
    *_, info = env.step("<answer>101</answer>")
    assert info["metrics"]["action_is_valid"] == 0.0
    _, reward, terminated, _, info = env.step(f"<answer>{secret}</answer>")
    assert terminated and reward == 1.0 and info["metrics"]["success"] == 1.0


def test_gym_adapter_on_gymnasium_frozen_lake() -> None:
    env = agentrl.make_env("agentrl/GymFrozenLakeText-v0")
    obs, _ = env.reset(seed=0)
    assert obs.splitlines()[0] == "PFFF" and env.expert_action() is None
    for move in ["Down", "Down", "Right", "Right", "Down"]:
        obs, reward, terminated, _, info = env.step(f"<answer>{move.lower()}</answer>")
    assert not terminated and obs.splitlines()[3] == "HFPG"
    obs, reward, terminated, _, info = env.step("<answer>Right</answer>")
    assert terminated and reward == 1.0 and info["metrics"]["success"] == 1.0
    with pytest.raises(ValueError, match="Discrete"):
        GymTextAdapter(gym.make("CartPole-v1"), ["Left"], lambda e, o: str(o), "x")


def test_answer_parser() -> None:
    parser = AnswerParser(max_actions=3)
    assert parser.parse("think <answer>a</answer> then <ANSWER> b || c ||d||e</answer>") == ["b", "c", "d"]
    assert parser.parse("no tags") is None and parser.parse("<answer> </answer>") is None
    assert parser.format(["Up", "Left"]) == "<answer>Up || Left</answer>"
    assert AnswerParser().parse("<answer>Up || Left</answer>") == ["Up || Left"]  # one action per turn
    with pytest.raises(ValueError, match="round-trip"):
        AnswerParser(pattern=r"\[(.*?)\]")
    with pytest.raises(ValueError, match="capture group"):
        AnswerParser(pattern="answer", answer_format="answer")


@pytest.mark.parametrize("env_id", BUILTIN)
def test_tokenizer_corpus_is_fast_and_covers_prompt_and_answers(env_id: str) -> None:
    env = agentrl.make_env(env_id)
    start = time.perf_counter()
    corpus = env.tokenizer_corpus(num_episodes=20, seed=0)
    assert time.perf_counter() - start < 1.0
    assert corpus[0] == env.system_prompt() and all(isinstance(t, str) for t in corpus)
    assert any(t.startswith("<answer>") for t in corpus) and len(corpus) > 40
    assert corpus == agentrl.make_env(env_id).tokenizer_corpus(num_episodes=20, seed=0)


def test_random_action_is_valid_and_seeded() -> None:
    env = agentrl.make_env("agentrl/SimpleSokoban-v0")
    env.reset(seed=0)
    a, b = random.Random(5), random.Random(5)
    texts = [env.random_action(a) for _ in range(20)]
    assert texts == [env.random_action(b) for _ in range(20)] and len(set(texts)) == 4


def test_long_tail_episodes_follow_their_seeded_plan() -> None:
    """A benchmark models the LongTail workload from `episode_plan`: the env must play exactly that plan."""
    from agentrl.envs.long_tail import episode_plan

    kwargs = {"median_turns": 2.0, "turns_sigma": 1.0, "max_steps": 12, "latency_s": 0.002, "latency_tail": 1.2}
    env = agentrl.make_env("agentrl/LongTail-v0", **kwargs)
    lengths = []
    for seed in range(12):
        plan = episode_plan(seed, **kwargs)
        assert plan == episode_plan(seed, **kwargs) and all(x >= kwargs["latency_s"] for x in plan)
        env.reset(seed=seed)
        t0, turns, terminated = time.perf_counter(), 0, False
        while not terminated:
            _, _, terminated, truncated, _ = env.step("hi")
            turns += 1
            assert not truncated
        assert turns == len(plan)
        assert time.perf_counter() - t0 >= sum(plan)
        lengths.append(turns)
    assert len(set(lengths)) > 2 and max(lengths) <= kwargs["max_steps"]  # uneven lengths, capped
