"""Sokoban mechanics, rewards, parsing and rendering, on hand-written grids (`reset(options={"grid": ...})`)."""

from __future__ import annotations

import random

import gymnasium as gym
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import agentrl
from agentrl.envs.sokoban import SYMBOL_SETS, parse_grid, render, solve


def make(**kwargs):
    return agentrl.make_env("agentrl/Sokoban-v0", **kwargs)


def play(env, grid: str, *answers: str):
    env.reset(seed=0, options={"grid": grid})
    return [env.step(a) for a in answers]


def test_push_onto_target_then_solve_bonus() -> None:
    env = make()
    obs, reward, terminated, truncated, info = play(env, "######\n#PX_O#\n######", "<answer>Right</answer>")[0]
    assert obs == "######\n#_PXO#\n######"
    assert reward == pytest.approx(-0.1) and not terminated and not truncated
    assert info["metrics"] == {"success": 0.0, "action_is_valid": 1.0, "action_is_effective": 1.0}
    obs, reward, terminated, _, info = env.step("<answer>Right</answer>")
    assert obs == "######\n#__P√#\n######"
    assert reward == pytest.approx(-0.1 + 1.0 + 10.0)  # step, box onto target, solved
    assert terminated and info["metrics"]["success"] == 1.0


def test_push_onto_and_off_target_without_solving() -> None:
    grid = "#######\n#PXO_O#\n#__X__#\n#######"  # two boxes: solving needs both
    (_, on, _, _, _), (obs, off, terminated, _, _) = play(
        make(), grid, "<answer>Right</answer>", "<answer>Right</answer>"
    )
    assert on == pytest.approx(0.9)  # -0.1 step + 1 onto target
    assert off == pytest.approx(-1.1)  # -0.1 step - 1 off target
    assert obs.splitlines()[1] == "#__SXO#" and not terminated


def test_walls_and_box_into_wall_are_no_ops() -> None:
    env = make()
    grid = "#####\n#P__#\n#_X_#\n#_#O#\n#####"
    env.reset(options={"grid": grid})
    obs, reward, _, _, info = env.step("<answer>Up</answer>")  # wall
    assert obs == grid and reward == pytest.approx(-0.1)
    assert info["metrics"]["action_is_valid"] == 1.0 and info["metrics"]["action_is_effective"] == 0.0
    env.reset(options={"grid": "#####\n#_P_#\n#_X_#\n#_#O#\n#####"})
    obs, _, _, _, info = env.step("<answer>Down</answer>")  # box into wall
    assert obs == "#####\n#_P_#\n#_X_#\n#_#O#\n#####" and info["metrics"]["action_is_effective"] == 0.0
    env.reset(options={"grid": "######\n#PXXO#\n######"})
    obs, _, _, _, info = env.step("<answer>Right</answer>")  # box into box
    assert obs == "######\n#PXXO#\n######" and info["metrics"]["action_is_effective"] == 0.0


@pytest.mark.parametrize("output", ["Right", "<answer>Jump</answer>", "<answer></answer>", "<answer>Up Left</answer>"])
def test_unparsable_output_is_a_penalised_no_op(output: str) -> None:
    env = make(format_penalty=-0.5)
    grid = "######\n#PX_O#\n######"
    obs, reward, terminated, truncated, info = play(env, grid, output)[0]
    assert obs == grid and not terminated and not truncated
    assert reward == pytest.approx(-0.5 - 0.1)
    assert info["metrics"] == {"success": 0.0, "action_is_valid": 0.0, "action_is_effective": 0.0}


@pytest.mark.parametrize("output", ["<answer>right</answer>", "<ANSWER> RIGHT </Answer>", "ok <answer>Right.</answer>"])
def test_answer_is_case_insensitive(output: str) -> None:
    obs, _, _, _, info = play(make(), "######\n#PX_O#\n######", output)[0]
    assert obs == "######\n#_PXO#\n######" and info["metrics"]["action_is_valid"] == 1.0


def test_custom_answer_pattern_and_several_actions_per_turn() -> None:
    env = make(answer_pattern=r"Action:\s*(.+)", answer_format="Action: {}", max_actions_per_turn=2,
               action_separator=",")  # fmt: skip
    assert "Action: Up , Left" in env.system_prompt()
    obs, reward, terminated, _, info = play(env, "######\n#PX_O#\n######", "Action: right, RIGHT, left")[0]
    assert obs == "######\n#__P√#\n######"
    assert terminated and info["actions"] == ["Right", "Right"]  # only the first 2 count
    assert reward == pytest.approx(2 * -0.1 + 1 + 10)
    assert env.expert_action() is None  # solved: no move left to teach
    assert env.parser.parse(env.random_action(random.Random(0)))
    env.reset(options={"grid": "######\n#PX_O#\n######"})
    assert env.expert_action() == "Action: Right"


def test_expert_gives_up_in_a_dead_position() -> None:
    env = make()
    env.reset(options={"grid": "#####\n#P_O#\n#__X#\n#####"})  # the box sits in a corner off the target
    assert env.expert_action() is None


def test_truncation_at_max_steps() -> None:
    env = make(max_steps=3)
    grid = "#######\n#P_X_O#\n#######"
    results = play(env, grid, *["<answer>Left</answer>"] * 3)
    assert [r[3] for r in results] == [False, False, True]
    assert not any(r[2] for r in results) and results[-1][4]["metrics"]["success"] == 0.0


def test_expert_replans_after_a_detour() -> None:
    env = make()
    env.reset(options={"grid": "#######\n#P_X_O#\n#_____#\n#######"})
    env.step("<answer>Down</answer>")  # off the optimal plan
    for _ in range(10):
        *_, terminated, _, info = env.step(env.expert_action())
        if terminated:
            break
    assert info["metrics"]["success"] == 1.0 and env.turns == 1 + 4  # Right, Up, Right, Right


def test_render_parse_roundtrip_and_solver_on_observation() -> None:
    env = agentrl.make_env("agentrl/LargerSokoban-v0")
    obs, info = env.reset(seed=11)
    state = parse_grid(f"Turn 1\n{obs}\nyour move?")  # surrounding text lines are ignored
    assert render(state) == obs and state == env.state
    assert len(solve(state)) == info["optimal_steps"]
    xsb = make(symbols="xsb")
    xsb_obs, _ = xsb.reset(seed=11)
    assert set(xsb_obs) <= set(SYMBOL_SETS["xsb"] + "\n") and "$" in xsb_obs
    plain = make()
    plain.reset(seed=11)
    assert parse_grid(xsb_obs) == xsb.state == plain.state  # same level, other vocabulary


def test_solver_edge_cases() -> None:
    assert solve(parse_grid("#####\n#P√_#\n#####")) == []
    assert solve(parse_grid("#####\n#X_P#\n#__O#\n#####")) is None  # box in a corner
    assert solve(parse_grid("P_XO")) == ["Right", "Right"]  # no outer walls: a ring is added
    with pytest.raises(ValueError):
        parse_grid("no grid here")


def test_gymnasium_make_and_env_checker() -> None:
    from gymnasium.utils.env_checker import check_env

    env = gym.make("agentrl/SimpleSokoban-v0")
    obs, _ = env.reset(seed=5)
    assert obs == agentrl.make_env("agentrl/SimpleSokoban-v0").reset(seed=5)[0]
    check_env(env.unwrapped)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), moves=st.lists(st.sampled_from(["Up", "Down", "Left", "Right"]), max_size=30))
def test_random_play_keeps_the_board_consistent(seed: int, moves: list[str]) -> None:
    env = agentrl.make_env("agentrl/LargerSokoban-v0", max_steps=100)
    env.reset(seed=seed)
    walls, targets = env.state.walls, env.state.targets
    for move in moves:
        obs, reward, terminated, _, _ = env.step(f"<answer>{move}</answer>")
        state = env.state
        assert len(state.boxes) == 2 and not state.boxes & walls and state.player not in walls | state.boxes
        assert state.targets == targets and parse_grid(obs) == state
        assert reward in {-0.1, 0.9, -1.1, 10.9}
        if terminated:
            break


def test_mark_revisits_counts_each_shown_position() -> None:
    """A blocked move or a step back shows the same grid again, marked with how often it was shown; render()
    and a new episode do not count."""
    env = make(mark_revisits=True)
    grid = "#####\n#P__#\n#_X_#\n#_#O#\n#####"
    obs, _ = env.reset(options={"grid": grid})
    assert obs == grid and env.render() is None
    obs, *_ = env.step("<answer>Up</answer>")  # into the wall: the same position again
    assert obs == f"{grid}\n(visit 2)"
    obs, *_ = env.step("<answer>Right</answer>")
    assert obs == "#####\n#_P_#\n#_X_#\n#_#O#\n#####"
    obs, *_ = env.step("<answer>Left</answer>")  # back
    assert obs == f"{grid}\n(visit 3)"
    obs, *_ = env.step("<answer>nonsense</answer>")  # an unparsable turn is shown again too
    assert obs == f"{grid}\n(visit 4)"
    assert parse_grid(obs) == env.state  # the mark is not part of the grid
    assert env.reset(options={"grid": grid})[0] == grid
    assert make().reset(options={"grid": grid})[0] == grid  # off by default


def test_mark_revisits_render_does_not_count() -> None:
    env = make(mark_revisits=True, render_mode="ansi")
    grid = "#####\n#P__#\n#_X_#\n#_#O#\n#####"
    env.reset(options={"grid": grid})
    assert env.render() == env.render() == grid
    env.step("<answer>Up</answer>")
    assert env.render() == env.render() == f"{grid}\n(visit 2)"
