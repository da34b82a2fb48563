"""`LongTailEnv` (agentrl/LongTail-v0): a workload env for measuring async rollout, not for learning.

Episodes have very uneven lengths (log-normal number of turns, seeded) and every step waits a heavy-tailed
latency, like a slow tool or simulator. Any output is a valid move; the final reward depends on the output so
GRPO groups have variance. Sync RL waits for the slowest episode of every batch; async RL does not.
"""

from __future__ import annotations

import math
import random
import time
from typing import Any

from agentrl.envs.base import TextEnv


def episode_plan(
    seed: int, median_turns: float, turns_sigma: float, max_steps: int, latency_s: float, latency_tail: float
) -> list[float]:
    """The latency of each step of the episode on task `seed` (its length is the list's): the episode is fixed by
    its seed, so a benchmark can model a workload without running it."""
    rng = random.Random(seed)
    turns = math.ceil(rng.lognormvariate(math.log(median_turns), turns_sigma))
    return [latency_s * rng.paretovariate(latency_tail) for _ in range(max(1, min(max_steps, turns)))]


class LongTailEnv(TextEnv):
    def __init__(
        self,
        median_turns: float = 2.0,
        turns_sigma: float = 1.0,
        max_steps: int = 12,
        latency_s: float = 0.02,
        latency_tail: float = 1.5,
        **text_kwargs: Any,
    ):
        super().__init__(max_steps=max_steps, **text_kwargs)
        self.median_turns, self.turns_sigma = float(median_turns), float(turns_sigma)
        self.latency_s, self.latency_tail = float(latency_s), float(latency_tail)

    def system_prompt(self) -> str:
        return "Say anything. The episode ends when it ends."

    def _new_episode(self, seed: int, options: dict[str, Any]) -> None:
        self._latencies = episode_plan(
            seed, self.median_turns, self.turns_sigma, self.max_steps, self.latency_s, self.latency_tail
        )

    def _observation(self) -> str:
        return f"turn {self.turns} of ?"

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self.latency_s > 0:
            time.sleep(self._latencies[min(self.turns, len(self._latencies) - 1)])
        self.turns += 1
        terminated = self.turns >= len(self._latencies)
        reward = float(len(action) % 2) if terminated else 0.0
        metrics = {"success": reward, "action_is_valid": 1.0, "action_is_effective": 1.0}
        return self._observation(), reward, terminated, False, {"metrics": metrics}

    def _canonical_action(self, text: str) -> str | None:
        return "say"

    def _is_success(self) -> bool:
        return False

    def _random_move(self, rng: random.Random) -> str:
        return "say"

    def tokenizer_corpus(self, num_episodes: int, seed: int) -> list[str]:
        return [self.system_prompt(), "turn 1 of ?"]
