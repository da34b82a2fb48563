"""Env libraries as env ids under a prefix, against the real libraries: reasoning-gym's task families, registered on
first use, scored by the library's own `score_answer`; a library that is not installed is a one-line error."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

import agentrl
from agentrl.config import ConfigError, load_config
from agentrl.config.loader import check_env_ids
from agentrl.envs import libraries
from agentrl.envs.checker import check_text_env

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ["basic_arithmetic", "chain_sum", "leg_counting", "word_sorting", "letter_counting", "number_sorting",
            "simple_equations", "base_conversion", "spell_backward", "caesar_cipher"]  # fmt: skip


def test_a_reasoning_gym_family_is_an_env_scored_by_the_library():
    env = agentrl.make_env("reasoning_gym/basic_arithmetic", config={"min_terms": 2, "max_terms": 2})
    obs, info = env.reset(seed=5)
    again, _ = agentrl.make_env("reasoning_gym/basic_arithmetic", config={"min_terms": 2, "max_terms": 2}).reset(seed=5)
    assert obs == again and info["task"]["question"] == obs  # task seed -> the same item, in any process
    answer = info["task"]["answer"]
    import reasoning_gym

    entry = reasoning_gym.create_dataset("basic_arithmetic", seed=0, size=1_000_000, min_terms=2, max_terms=2)[5]
    assert entry["question"] == obs and entry["answer"] == answer  # what the library itself makes for item 5
    _, reward, terminated, _, info = env.step(f"Let me think. \\boxed{{{answer}}}")
    assert terminated and reward == 1.0 and info["metrics"]["success"] == 1.0
    env.reset(seed=5)
    _, reward, terminated, _, info = env.step("<answer>not a number</answer>")
    assert terminated and reward < 1.0 and info["metrics"]["success"] == 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_check_env_passes_reasoning_gym_families(family):
    report = check_text_env(f"reasoning_gym/{family}", {}, episodes=8, seed=0, timeout_s=30)
    assert report["ok"] and report["expert"]["success_rate"] == 1.0, report["violations"]


def test_unknown_family_and_missing_library_are_one_line_errors(monkeypatch):
    with pytest.raises(agentrl.envs.UnknownEnvError, match=r"reasoning_gym has: .*basic_arithmetic"):
        agentrl.make_env("reasoning_gym/no_such_family")
    monkeypatch.setitem(libraries.LIBRARIES, "nolib", ("agentrl_no_such_library", "no-such-library", "x"))
    with pytest.raises(libraries.MissingLibraryError, match=r"pip install 'agentrl\[envlibs\]'"):
        agentrl.make_env("nolib/Game-v0")
    cfg = load_config(None, [])
    cfg.envs.train = {"x": {"env_id": "nolib/Game-v0"}}
    with pytest.raises(ConfigError, match=r"envs.train.x.env_id: nolib/Game-v0 needs the no-such-library library"):
        check_env_ids(cfg)


def test_envs_lists_the_installed_libraries():
    out = subprocess.run([sys.executable, "-m", "agentrl", "envs", "--json"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    table = json.loads(out.stdout)
    families = [i for i in table if i.startswith("reasoning_gym/")]
    assert len(families) >= 100 and table["reasoning_gym/basic_arithmetic"]["task"] == "basic_arithmetic"
    assert table["gem/game:Sokoban-v0-easy"]["env"] == "game:Sokoban-v0-easy"  # GEM's ids, under its prefix


GAMES = ["TicTacToe-v0", "ConnectFour-v0", "Nim-v0", "GuessTheNumber-v0", "Mastermind-v0"]


def test_a_textarena_game_against_a_random_opponent():
    env = agentrl.make_env("textarena/TicTacToe-v0")
    obs, _ = env.reset(seed=3)
    assert "Tic Tac Toe" in obs and "Available Moves" in obs
    assert agentrl.make_env("textarena/TicTacToe-v0").reset(seed=3)[0] == obs
    rewards = []
    for seed in range(6):
        obs, _ = env.reset(seed=seed)
        rng = random.Random(seed)
        for _ in range(9):
            obs, reward, terminated, truncated, info = env.step(env.random_action(rng))
            if terminated or truncated:
                break
        assert terminated and info["metrics"]["win"] + info["metrics"]["draw"] + info["metrics"]["loss"] == 1.0
        rewards.append(reward)
    assert set(rewards) <= {-1.0, 0.0, 1.0} and len(set(rewards)) > 1  # the game's own results, not all alike
    env.reset(seed=0)
    obs, reward, terminated, _, info = env.step("I am not sure")  # TextArena's own invalid-move rule: one retry
    assert not terminated and info["metrics"]["action_is_valid"] == 0.0 and "invalid move" in obs.lower()
    _, reward, terminated, _, info = env.step("still not sure")
    assert terminated and reward == -1.0 and info["metrics"]["invalid_move"] == 1.0


def _play(env, seeds, act):
    results = []
    for seed in seeds:
        env.reset(seed=seed)
        for _ in range(30):
            _, reward, terminated, truncated, info = env.step(act(env))
            if terminated or truncated:
                break
        assert terminated and info["metrics"]["invalid_move"] == 0.0
        results.append(reward)
    return results


@pytest.mark.parametrize("game", ["TicTacToe-v0", "Nim-v0"])
def test_the_perfect_player_never_loses_and_beats_a_random_opponent(game):
    """The expert the SFT warm start imitates (minimax / nim-sum) on the real games, in either seat."""
    first = _play(agentrl.make_env(f"textarena/{game}"), range(40), lambda env: env.expert_action())
    assert min(first) >= 0.0 and first.count(1.0) >= 34  # first player: it wins almost every game against random
    second = _play(agentrl.make_env(f"textarena/{game}", seat=1), range(40), lambda env: env.expert_action())
    assert min(second) >= 0.0 if game == "TicTacToe-v0" else second.count(1.0) >= 30
    against_itself = _play(agentrl.make_env(f"textarena/{game}", opponent="expert"), range(5),
                           lambda env: env.expert_action())  # fmt: skip
    assert set(against_itself) == ({0.0} if game == "TicTacToe-v0" else {1.0})  # TTT is a draw; Nim's start is won
    rng = random.Random(0)
    random_first = _play(agentrl.make_env(f"textarena/{game}", opponent="expert"), range(20),
                         lambda env: env.random_action(rng))  # fmt: skip
    assert max(random_first) <= 0.0 if game == "TicTacToe-v0" else random_first.count(-1.0) >= 15


def test_tictactoe_expert_wins_now_blocks_and_has_no_expert_once_over():
    from agentrl.envs.textarena_env import nim_expert, tictactoe_expert

    assert tictactoe_expert([["O", "O", ""], ["X", "X", ""], ["", "", ""]], "X") == "[5]"  # win rather than block
    assert tictactoe_expert([["O", "O", ""], ["X", "", ""], ["", "", ""]], "X") == "[2]"  # block
    assert tictactoe_expert([["", "", ""]] * 3, "O") == "[4]"
    assert nim_expert([3, 4, 5]) == "[0 2]" and nim_expert([1, 1]) == "[0 1]"  # leave nim-sum 0; lost: take one
    env = agentrl.make_env("textarena/TicTacToe-v0")
    env.reset(seed=0)
    env.step("nonsense")
    env.step("nonsense")  # the second invalid move ends the game
    assert env.expert_action() is None
    assert agentrl.make_env("textarena/GuessTheNumber-v0").expert_action() is None
    with pytest.raises(ValueError, match="no expert opponent"):
        agentrl.make_env("textarena/ConnectFour-v0", opponent="expert")


def test_a_frozen_snapshot_opponent_plays_its_seat_with_the_policys_view(tmp_path):
    """`opponent: snapshot:PATH`: a model folder (here the tiny model as built) plays the other seat greedily, seeing
    its seat's newest text as the policy does with `observation: new`."""
    from agentrl.envs.snapshot_opponent import SnapshotOpponent
    from agentrl.models.tiny import resolve_model_path

    path = resolve_model_path("builtin:tiny")
    env = agentrl.make_env("textarena/TicTacToe-v0", opponent=f"snapshot:{path}", observation="new")
    seen: list[str] = []
    snapshot = env.opponent
    env.opponent = lambda text, rng: seen.append(text) or snapshot(text, rng)
    results = _play(env, range(3), lambda env: env.expert_action())
    assert set(results) <= {1.0, 0.0} and seen  # it moved (validly or not: TextArena judges), and never won
    direct = SnapshotOpponent(path, env.system_prompt())
    assert isinstance(snapshot, SnapshotOpponent) and direct(seen[-1], random.Random(0)) == snapshot(seen[-1], None)
    rules = sum("three in a row" in text for text in seen)  # the rules: in its first view of each game only
    assert rules <= 3 < len(seen)  # later views are what is new since its last turn, not the whole log
    with pytest.raises(ValueError, match="is not a model folder"):
        agentrl.make_env("textarena/TicTacToe-v0", opponent=f"snapshot:{tmp_path}")


@pytest.mark.parametrize("game", GAMES)
def test_check_env_passes_textarena_games_with_warnings_for_agentrl_only_rules(game):
    report = check_text_env(f"textarena/{game}", {}, episodes=6, seed=0, timeout_s=30)
    assert report["ok"], report["violations"]
    assert any("unparsable_is_noop" in w for w in report["warnings"])  # reported, not failed


def test_a_game_that_needs_network_data_is_a_one_line_error_at_construction(tmp_path, monkeypatch):
    monkeypatch.setenv("NLTK_DATA", str(tmp_path))  # an empty data folder: the corpus is not there, nor fetchable
    out = subprocess.run([sys.executable, "-m", "agentrl", "check-env", "textarena/Wordle-v0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "needs the nltk data 'words'" in lines[0] and "python -m nltk.downloader words" in lines[0]


GSM8K_ROWS = [
    {"prompt": [{"role": "system", "content": "Solve it. End with #### ANSWER."},
                {"role": "user", "content": "Tom has 3 apples and buys 4. How many?"}],
     "reward_spec": {"ground_truth": "7"}, "extra_info": {}},
    {"prompt": [{"role": "user", "content": "What is 6 times 7?"}], "reward_spec": {"ground_truth": "42"},
     "extra_info": {}},
]  # fmt: skip


@pytest.mark.parametrize("env_name", ["gsm8k", "gsm8k_multi_turn"])
def test_skyrl_gym_envs_on_a_dataset_scored_by_the_library(tmp_path, env_name):
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in GSM8K_ROWS))
    kwargs = {"path": str(data), "expert_format": "#### {}"}
    env = agentrl.make_env(f"skyrl_gym/{env_name}", **kwargs)
    obs, info = env.reset(seed=0)
    assert obs == "Tom has 3 apples and buys 4. How many?" and env.system_prompt().startswith("Solve it.")
    assert info["task"]["reward_spec"] == {"ground_truth": "7"}
    _, reward, terminated, _, _ = env.step("4 + 3 = 7\n#### 7")
    assert reward == 1.0 and terminated  # skyrl-gym's own compute_score
    env.reset(seed=1)
    _, reward, _, _, _ = env.step("#### 41")
    assert reward < 1.0
    report = check_text_env(f"skyrl_gym/{env_name}", kwargs, episodes=4, seed=0, timeout_s=30)
    assert report["ok"] and report["expert"]["success_rate"] == 1.0, report["violations"]
    with pytest.raises(ValueError, match="takes its tasks from a dataset"):
        agentrl.make_env(f"skyrl_gym/{env_name}")


async def _seat(env, moves: list[str], seed: int) -> tuple[list, str]:
    """A scripted player of one self-play seat: its moves in turn until its episode ends."""
    obs, _ = await env.areset(seed=seed)
    steps = []
    for move in moves:
        obs, reward, terminated, truncated, info = await env.astep(move)
        steps.append((reward, terminated, truncated, info["metrics"]["action_is_valid"]))
        if terminated or truncated:
            break
    await env.aclose()
    return steps, obs


async def test_textarena_self_play_seats_share_one_game():
    """Two seats of TicTacToe, each its own env (as two episodes have them), on one table: moves alternate, an
    invalid move is the mover's to retry, the result is each seat's own (+1 / -1), and a seat that leaves early
    (its episode ended) truncates the other's."""
    from envs.textarena_env import SelfPlayTable

    first = agentrl.make_env("textarena/TicTacToe-v0", seat=0, table="g1")
    second = agentrl.make_env("textarena/TicTacToe-v0", seat=1, table="g1")
    (a, a_obs), (b, b_obs) = await asyncio.gather(
        _seat(first, ["[4]", "[2]", "[6]"], 3), _seat(second, ["nonsense", "[0]", "[8]"], 3)
    )
    assert a == [(0.0, False, False, 1.0), (0.0, False, False, 1.0), (1.0, True, False, 1.0)]  # 4-2-6: a diagonal
    assert b == [(0.0, False, False, 0.0), (0.0, False, False, 1.0), (-1.0, True, False, 1.0)]
    assert (a_obs, b_obs) == ("Game over: won.", "Game over: lost.")
    assert not SelfPlayTable._open

    first = agentrl.make_env("textarena/TicTacToe-v0", seat=0, table="g2")
    second = agentrl.make_env("textarena/TicTacToe-v0", seat=1, table="g2")
    (a, _), (b, b_obs) = await asyncio.gather(_seat(first, ["[4]"], 5), _seat(second, ["[0]", "[1]"], 5))
    assert a == [(0.0, False, False, 1.0)] and b == [(0.0, False, True, 1.0)]  # seat 0's episode ended: truncated
    assert "left" in b_obs and not SelfPlayTable._open


def test_the_preflight_check_builds_a_self_play_env_as_a_seat_and_refuses_one_without_seats():
    from agentrl.envmanager.manager import _make_each_env

    ttt = ("envs.train.ttt", "textarena/TicTacToe-v0", {}, 0, None, True)
    assert _make_each_env([ttt], 30.0) is None
    sokoban = ("envs.train.box", "agentrl/SimpleSokoban-v0", {}, 0, None, True)
    problem = _make_each_env([sokoban], 30.0)
    assert problem is not None and problem.startswith("envs.train.box.self_play: agentrl/SimpleSokoban-v0 has no seats")


GEM_GAMES = ["game:Sokoban-v0-easy", "game:GuessTheNumber-v0-easy", "game:Minesweeper-v0-easy", "rg:basic_arithmetic"]


def test_a_gem_game_is_an_env_by_gems_own_id_judged_by_gem():
    env = agentrl.make_env("gem/game:GuessTheNumber-v0-easy")
    obs, _ = env.reset(seed=4)
    assert "Guess The Number" in obs and obs.endswith("Enter your next guess.")  # GEM's text, then its suffix
    assert agentrl.make_env("gem/game:GuessTheNumber-v0-easy").reset(seed=4)[0] == obs  # reproducible per seed
    low, high = 1, 10  # binary search on GEM's own hints: it wins, by GEM's reward
    for _ in range(4):
        guess = (low + high) // 2
        obs, reward, terminated, truncated, info = env.step(f"My guess: \\boxed{{{guess}}}")
        if terminated:
            break
        low, high = (guess + 1, high) if "higher" in obs else (low, guess - 1)
    assert terminated and not truncated and reward == 1.0 and info["metrics"]["success"] == 1.0
    env.reset(seed=4)
    obs, reward, terminated, _, info = env.step("no box here")  # GEM's own rule: a format error ends the game
    assert terminated and info["metrics"]["success"] == 0.0 and "valid" in obs


@pytest.mark.parametrize("env_id", GEM_GAMES)
def test_check_env_passes_gem_envs_with_warnings_for_agentrl_only_rules(env_id):
    report = check_text_env(f"gem/{env_id}", {}, episodes=4, seed=0, timeout_s=60)
    assert report["ok"], report["violations"]
    assert any("unparsable_is_noop" in w or "gymnasium" in w for w in report["warnings"])


def test_gem_envs_that_fetch_data_are_one_line_errors_at_construction(tmp_path, monkeypatch):
    monkeypatch.setenv("NLTK_DATA", str(tmp_path))  # an empty data folder: nltk's corpus is not there
    for env_id, says in [("gem/game:Wordle-v0-easy", "needs the nltk data 'words'"),
                         ("gem/math:GSM8K", "loads its tasks from the Hugging Face hub")]:  # fmt: skip
        out = subprocess.run([sys.executable, "-m", "agentrl", "check-env", env_id], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)  # fmt: skip
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and says in lines[0], out.stderr


def test_gem_episodes_are_reproducible_beside_other_threads():
    """GEM seeds the global RNGs in reset and draws from them in steps (2048's new tiles): with each env's own RNG
    states swapped in, episodes on concurrent threads play exactly as they do alone, and the process's RNG is
    left where it was."""
    from concurrent.futures import ThreadPoolExecutor

    moves = ["\\boxed{up}", "\\boxed{left}", "\\boxed{down}", "\\boxed{right}"] * 3

    def play(env, seed: int) -> list[str]:
        seen = [env.reset(seed=seed)[0]]
        return seen + [env.step(move)[0] for move in moves]

    alone = {seed: play(agentrl.make_env("gem/game:Game2048-v0-easy"), seed) for seed in range(6)}
    envs = [agentrl.make_env("gem/game:Game2048-v0-easy") for _ in range(6)]
    random.seed(123)
    before = random.random()
    random.seed(123)
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(lambda i: play(envs[i], i), range(6)))
    assert together == [alone[i] for i in range(6)] and len({t[-1] for t in together}) > 1
    assert random.random() == before  # GEM's draws came from the envs' own states


RACE = """
import sys
from concurrent.futures import ThreadPoolExecutor
import agentrl
ids = ["reasoning_gym/basic_arithmetic", "gem/game:Sokoban-v0-easy", "textarena/Nim-v0"] * 4
with ThreadPoolExecutor(len(ids)) as pool:
    envs = list(pool.map(agentrl.make_env, ids))
print(sorted({type(e).__name__ for e in envs}))
"""


def test_library_envs_built_on_many_threads_at_once_in_a_fresh_process():
    """An env manager builds envs on several threads: the first ids of a library register it once, whole, while
    the other threads wait (without the lock a thread read reasoning-gym's registry half-filled)."""
    out = subprocess.run([sys.executable, "-c", RACE], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "['GEMEnv', 'ReasoningGymEnv', 'TextArenaEnv']"
    assert "nltk_data" not in out.stdout + out.stderr  # the libraries' import noise is not ours to print
