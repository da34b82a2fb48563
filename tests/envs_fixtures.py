"""Envs defined outside agentrl, registered with `agentrl.register_env`: loaded by CLI tests via
`agentrl envs --import tests.envs_fixtures`."""

from __future__ import annotations

import random
import time
from typing import Any

import agentrl
from agentrl.envs import Move, TextEnv


class CountToEnv(TextEnv):
    """Say the next number until `target`: the smallest well-behaved text env."""

    def __init__(self, target: int = 3, max_steps: int = 6, **text_kwargs: Any) -> None:
        super().__init__(max_steps=max_steps, **text_kwargs)
        self.target = target

    def system_prompt(self) -> str:
        return f"Count from 1 to {self.target}, one number per turn, e.g. {self.parser.format(['1'])}"

    def _new_episode(self, seed: int, options: dict[str, Any]) -> None:
        self.count = 0

    def _observation(self) -> str:
        return f"Count: {self.count}"

    def _canonical_action(self, text: str) -> str | None:
        return text.strip() if text.strip().isdigit() else None

    def _apply(self, action: str) -> Move:
        if int(action) != self.count + 1:
            return Move(0.0, False, False)
        self.count += 1
        return Move(1.0 if self.count == self.target else 0.0, True, self.count == self.target)

    def _is_success(self) -> bool:
        return self.count == self.target

    def _expert_move(self) -> str | None:
        return str(self.count + 1)

    def _random_move(self, rng: random.Random) -> str:
        return str(rng.randint(1, self.target))


class NoMetricsEnv(CountToEnv):
    """Breaks the contract: step() info has no metrics."""

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        obs, reward, terminated, truncated, _ = super().step(action)
        return obs, reward, terminated, truncated, {}


class HangingEnv(CountToEnv):
    """Hangs for `hang_s` seconds in `hang_in` (init, reset or step) on episodes whose seed is a multiple of
    `every` (an unseeded reset never hangs); raises in step on seeds that leave 1 modulo `raise_every` (0: never).
    The drill of a bad user env."""

    def __init__(self, hang_in: str = "step", hang_s: float = 30.0, every: int = 3, raise_every: int = 0,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(**kwargs)
        self.hang_in, self.hang_s, self.every, self.raise_every = hang_in, hang_s, every, raise_every
        self.seed: int | None = None
        if hang_in == "init":
            time.sleep(hang_s)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self.seed = seed
        if self.hang_in == "reset" and self._marked(self.every):
            time.sleep(self.hang_s)
        return super().reset(seed=seed, options=options)

    def step(self, action: str):
        if self.hang_in == "step" and self._marked(self.every):
            time.sleep(self.hang_s)
        if self.raise_every and self.seed is not None and self.seed % self.raise_every == 1:
            raise RuntimeError("the env's own bug")
        return super().step(action)

    def _marked(self, every: int) -> bool:
        return self.seed is not None and self.seed % every == 0


agentrl.register_env("tests/CountTo-v0", CountToEnv, target=3)
agentrl.register_env("tests/Hanging-v0", HangingEnv)
agentrl.register_env("tests/NoMetrics-v0", NoMetricsEnv)
