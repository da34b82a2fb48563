"""`GuessNumberEnv`: find a secret number from higher/lower hints, an env that needs several turns of
information gathering (each observation is only the latest hint, so the agent must remember the others)."""

from __future__ import annotations

import random
from typing import Any

from agentrl.envs.base import Move, TextEnv


class GuessNumberEnv(TextEnv):
    """Guess a number in [1, max_number]; hints say "too low" / "too high"; `correct_reward` on success.

    `action_is_effective` is 1 when the guess was still possible given the earlier hints (it gathers
    information). The expert bisects, so it needs at most ceil(log2(max_number + 1)) turns.
    """

    def __init__(self, max_number: int = 100, max_steps: int = 10, correct_reward: float = 1.0, **text_kwargs: Any):
        super().__init__(max_steps=max_steps, **text_kwargs)
        if max_number < 1:
            raise ValueError(f"max_number must be >= 1, got {max_number}")
        self.max_number, self.correct_reward = int(max_number), float(correct_reward)

    def system_prompt(self) -> str:
        return (
            f"Guess my secret whole number from 1 to {self.max_number}. After each guess I say whether it is "
            "too low or too high.\n"
            f"Answer with one number per turn, e.g. {self.parser.format([str((self.max_number + 1) // 2)])}"
        )

    def _new_episode(self, seed: int, options: dict[str, Any]) -> None:
        self._secret = random.Random(seed).randint(1, self.max_number)
        self._low, self._high = 1, self.max_number  # what the hints so far allow
        self._last: int | None = None

    def _observation(self) -> str:
        if self._last is None:
            return f"I picked a number from 1 to {self.max_number}. Your guess?"
        if self._last == self._secret:
            return f"{self._last} is correct!"
        return f"{self._last} is too {'low' if self._last < self._secret else 'high'}."

    def _canonical_action(self, text: str) -> str | None:
        text = text.strip().rstrip(".")
        if not text.lstrip("-").isdigit() or not 1 <= int(text) <= self.max_number:
            return None
        return str(int(text))

    def _apply(self, action: str) -> Move:
        guess = int(action)
        informative = self._low <= guess <= self._high
        if guess < self._secret:
            self._low = max(self._low, guess + 1)
        elif guess > self._secret:
            self._high = min(self._high, guess - 1)
        self._last = guess
        correct = guess == self._secret
        return Move(self.correct_reward if correct else 0.0, informative, correct)

    def _is_success(self) -> bool:
        return self._last == self._secret

    def _expert_move(self) -> str | None:
        return str((self._low + self._high) // 2)

    def _random_move(self, rng: random.Random) -> str:
        return str(rng.randint(1, self.max_number))
