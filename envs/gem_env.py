"""`gem/<id>`: GEM's envs (`gem/game:Sokoban-v0-easy`, `gem/game:Minesweeper-v0-easy`, `gem/rg:basic_arithmetic`,
...) as text envs, by GEM's own ids.

GEM envs are gym-like text envs already: `reset(seed) -> (text, info)`, `step(text) -> (text, reward, terminated,
truncated, info)`, moves in `\\boxed{}`. The observation is GEM's text followed by its `info["suffix"]` (the board
and the question for the next move), as GEM's own agents read it; GEM's reward, termination and turn limit are the
episode's. Success is ending the episode (not by the turn limit) with GEM's success reward (1.0). GEM seeds Python's
and numpy's global RNGs in `reset` and draws from them in some steps (2048's new tiles), so each env runs its calls
under a process-wide lock with its own RNG states swapped in: envs on the env manager's threads stay reproducible
per seed, and nothing else's random stream moves. What an env fetches from the network (nltk corpora, hub
datasets) is a one-line error at construction.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from agentrl.envs.base import TextEnv
from agentrl.envs.libraries import quiet
from agentrl.envs.library_errors import offline_data_error

PREFIX = "gem/"
SUCCESS_REWARD = 1.0  # gem.utils.constants.LanguageGameReward.success_reward
_GLOBAL_RNG = threading.Lock()  # GEM seeds and draws from random / numpy's global RNGs


class GEMEnv(TextEnv):
    contract = frozenset()  # GEM judges moves its own way (an unparsable one may end the game)

    def __init__(self, env: str, env_kwargs: dict[str, Any] | None = None, max_steps: int = 100,
                 system_prompt: str = "", **text_kwargs: Any) -> None:  # fmt: skip
        """`env`: GEM's id; `env_kwargs`: GEM's own settings for it; `max_steps` bounds envs GEM leaves unbounded."""
        super().__init__(max_steps=max_steps, **text_kwargs)
        import gem

        self.env_id = f"{PREFIX}{env}"
        try:
            with quiet():  # nltk's download attempts
                self.inner = gem.make(env, **(env_kwargs or {}))
        except Exception as err:
            raise (offline_data_error(self.env_id, err) or err) from None
        self._system = system_prompt or "Think briefly, then give your answer or move in \\boxed{}."
        self._text, self._done = "", False
        self._rngs: tuple[Any, Any] | None = None  # this env's (random, numpy) states between its calls

    @contextlib.contextmanager
    def _own_rngs(self) -> Iterator[None]:
        """GEM's global RNG draws, made this env's own: its states in for the call, the process's back after."""
        with _GLOBAL_RNG:
            saved = random.getstate(), np.random.get_state()
            if self._rngs is not None:
                random.setstate(self._rngs[0])
                np.random.set_state(self._rngs[1])
            try:
                yield
            finally:
                self._rngs = random.getstate(), np.random.get_state()
                random.setstate(saved[0])
                np.random.set_state(saved[1])

    def system_prompt(self) -> str:
        return self._system

    def _new_episode(self, seed: int, options: dict[str, Any]) -> None:
        with self._own_rngs():
            text, info = self.inner.reset(seed=seed)
        self._text, self._done, self._success = self._with_suffix(text, info), False, False

    def _observation(self) -> str:
        return self._text

    @staticmethod
    def _with_suffix(text: str, info: dict) -> str:
        suffix = (info or {}).get("suffix")
        return f"{text}\n{suffix}" if suffix else str(text)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        """GEM's own step: its reward, its end, its next text."""
        if not isinstance(action, str):
            raise TypeError(f"{type(self).__name__}.step expects model output text, got {type(action).__name__}")
        with self._own_rngs():
            text, reward, terminated, truncated, info = self.inner.step(action)
        self.turns += 1
        reward = float(reward)
        self._done = bool(terminated or truncated)
        self._success = bool(terminated) and not truncated and reward >= SUCCESS_REWARD
        truncated = bool(truncated) or (not self._done and self.turns >= self.max_steps)
        self._text = self._with_suffix(text, info)
        metrics = {"success": float(self._success), "action_is_valid": 1.0, "action_is_effective": 1.0}
        return self._text, reward, bool(terminated), truncated, {"metrics": metrics, "task": {"env": self.env_id}}

    def random_action(self, rng: random.Random) -> str:
        """GEM's own random move where the env has one, else a random number in `\\boxed{}`."""
        with _GLOBAL_RNG:
            state = random.getstate()
            random.seed(rng.getrandbits(31))  # GEM draws from the global RNG: a seeded draw, then as it was
            try:
                return str(self.inner.sample_random_action())
            except NotImplementedError:
                return f"\\boxed{{{random.randint(0, 9)}}}"
            finally:
                random.setstate(state)

    # the base class's hooks, unused: GEM parses and judges the text itself
    def _canonical_action(self, text: str) -> str | None:
        return text

    def _apply(self, action: str):
        raise NotImplementedError

    def _is_success(self) -> bool:
        return self._success

    def _random_move(self, rng: random.Random) -> str:
        return self.random_action(rng)


def register() -> list[str]:
    """Register `gem/<id>` for every env of the installed GEM (importing it imports GEM's env modules' registry)."""
    with quiet():  # its dependencies' own SyntaxWarnings (cellpylib) on first import
        from gem.envs.registration import ENV_REGISTRY

    from agentrl.envs.registry import register_env

    ids = []
    for name in sorted(ENV_REGISTRY):
        register_env(f"{PREFIX}{name}", f"{__name__}:GEMEnv", env=name)
        ids.append(f"{PREFIX}{name}")
    return ids
