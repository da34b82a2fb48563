"""Envs defined outside agentrl, registered with `agentrl.register_env`: loaded by CLI tests via
`agentrl envs --import tests.envs_fixtures`."""

from __future__ import annotations

import random
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


agentrl.register_env("tests/CountTo-v0", CountToEnv, target=3)
agentrl.register_env("tests/NoMetrics-v0", NoMetricsEnv)
