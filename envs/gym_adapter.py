"""`GymTextAdapter`: any gymnasium env with a Discrete action space becomes a text env, given a renderer
(observation -> text) and action names. Shown on gymnasium's own toy-text FrozenLake.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from agentrl.envs.base import Move, TextEnv
from agentrl.envs.parsing import DEFAULT_ANSWER_FORMAT


class GymTextAdapter(TextEnv):
    """Text front end for a non-text gymnasium env.

    `render_obs(env, obs)` writes the observation as text; `action_names[i]` names discrete action i (matched
    case-insensitively); `instructions` is the system prompt (the answer format line is appended). Success is
    `success_fn(reward, terminated, info)`, by default "terminated with positive reward". The inner env's own
    truncation also ends the episode.
    """

    def __init__(
        self,
        env: gym.Env,
        action_names: Sequence[str],
        render_obs: Callable[[gym.Env, Any], str],
        instructions: str,
        success_fn: Callable[[float, bool, dict], bool] | None = None,
        **text_kwargs: Any,
    ) -> None:
        super().__init__(**text_kwargs)
        if not isinstance(env.action_space, gym.spaces.Discrete) or env.action_space.n != len(action_names):
            raise ValueError(f"need a Discrete({len(action_names)}) action space, got {env.action_space}")
        self.env, self.action_names, self.render_obs = env, list(action_names), render_obs
        self.instructions = instructions
        self.success_fn = success_fn or (lambda reward, terminated, info: terminated and reward > 0)
        self._by_name = {name.lower(): name for name in self.action_names}

    def system_prompt(self) -> str:
        example = self.parser.format([self.action_names[0]])
        return f"{self.instructions}\nAnswer with one action ({', '.join(self.action_names)}), e.g. {example}"

    def _new_episode(self, seed: int, options: dict[str, Any]) -> None:
        self._obs, _ = self.env.reset(seed=seed, options=options or None)
        self._success = False

    def _observation(self) -> str:
        return self.render_obs(self.env, self._obs)

    def _canonical_action(self, text: str) -> str | None:
        return self._by_name.get(text.strip().rstrip(".").lower())

    def _apply(self, action: str) -> Move:
        before = self._obs
        self._obs, reward, terminated, truncated, info = self.env.step(self.action_names.index(action))
        self._success = bool(self.success_fn(float(reward), bool(terminated), info))
        return Move(float(reward), not np.array_equal(before, self._obs), bool(terminated or truncated))

    def _is_success(self) -> bool:
        return self._success

    def _random_move(self, rng: random.Random) -> str:
        return rng.choice(self.action_names)

    def close(self) -> None:
        self.env.close()


def _render_frozen_lake(env: gym.Env, obs: Any) -> str:
    desc = env.unwrapped.desc  # bytes grid: S F H G
    ncol = desc.shape[1]
    rows = [[c.decode() for c in row] for row in desc]
    rows[int(obs) // ncol][int(obs) % ncol] = "P"
    return "\n".join("".join(row) for row in rows)


def gym_frozen_lake_text(
    map_name: str = "4x4",
    is_slippery: bool = False,
    max_steps: int = 20,
    answer_format: str = DEFAULT_ANSWER_FORMAT,
    **text_kwargs: Any,
) -> GymTextAdapter:
    """gymnasium's FrozenLake-v1 (fixed map) through `GymTextAdapter`: the adapter demo."""
    inner = gym.make("FrozenLake-v1", map_name=map_name, is_slippery=is_slippery, disable_env_checker=True)
    return GymTextAdapter(
        inner,
        action_names=["Left", "Down", "Right", "Up"],  # gymnasium's action order
        render_obs=_render_frozen_lake,
        instructions="FrozenLake: walk to the goal G without stepping into a hole H.\n"
        "S start, F frozen ice, H hole, G goal, P you.",
        max_steps=max_steps,
        answer_format=answer_format,
        **text_kwargs,
    )
