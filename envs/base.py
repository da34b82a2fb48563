"""`TextEnv`: the gymnasium-style text env contract every agentrl env implements.

Why a base class: the env owns its prompt text, action parsing, format penalty, turn limit and metrics, so the
env manager can stay generic and run every env the same way. Subclasses implement a handful of `_hooks` on
canonical actions and never see raw model output.
"""

from __future__ import annotations

import random
import string
from typing import Any, ClassVar, NamedTuple

import gymnasium as gym
from gymnasium import spaces

from agentrl.envs.parsing import (
    DEFAULT_ANSWER_FORMAT,
    DEFAULT_ANSWER_PATTERN,
    DEFAULT_SEPARATOR,
    AnswerParser,
)

# Observations and actions are free text; gymnasium's Text space needs an explicit character set.
TEXT_CHARSET = string.printable + "√"
TEXT_MAX_LENGTH = 8192
REQUIRED_METRICS = ("success", "action_is_valid", "action_is_effective")


class Move(NamedTuple):
    """What one canonical action did: reward (without the per-step penalty), whether the state changed, and
    whether the episode ended."""

    reward: float
    effective: bool
    terminated: bool


class TextEnv(gym.Env[str, str]):
    """A gymnasium env whose observations and actions are text.

    `reset(seed, options) -> (observation, info)` and `step(model_output) -> (observation, reward, terminated,
    truncated, info)` with `info["metrics"]` holding floats `success`, `action_is_valid` and
    `action_is_effective`. The first prompt is [system: `system_prompt()`, user: observation]; every later
    observation is a new user message.

    Output that does not parse (or names an unknown action) is a no-op that costs `format_penalty` plus the
    step penalty. With `max_actions_per_turn > 1` one turn may carry several actions joined by
    `action_separator`; they run in order until the episode ends. A turn is one `step` call; the episode is
    truncated after `max_steps` turns.
    """

    metadata: dict[str, Any] = {"render_modes": ["ansi"], "render_fps": 4}  # noqa: RUF012  (gymnasium's)
    step_penalty: float = 0.0
    inline_step: ClassVar[bool] = False
    """True for a class whose `step` is pure Python that takes microseconds and never blocks (the built-in
    Sokoban): env managers then call it on their event loop instead of handing it to their thread pool, whose
    hop cost ~4x a Sokoban step's own CPU (220 vs 59 us). Such a step is not under `envs.call_timeout_s`. Each
    class declares it for itself: a subclass that does not is back on the thread pool, since its step may block."""

    contract: ClassVar[frozenset[str]] = frozenset({"unparsable_is_noop", "gymnasium_checker", "system_prompt"})
    """agentrl's own rules this env promises, beyond what every env must do (which `check-env` always enforces):
    `unparsable_is_noop` (unparsable output gives action_is_valid=0 and leaves the state as it was),
    `gymnasium_checker` (gymnasium's env checker, seeding included, passes) and `system_prompt` (a non-empty one).
    Envs adapted from other libraries need not promise them; `check-env` then reports those rules as warnings, not
    failures."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "inline_step" not in cls.__dict__:
            cls.inline_step = False

    def __init__(
        self,
        *,
        max_steps: int = 20,
        format_penalty: float = -0.1,
        answer_pattern: str = DEFAULT_ANSWER_PATTERN,
        answer_format: str = DEFAULT_ANSWER_FORMAT,
        action_separator: str = DEFAULT_SEPARATOR,
        max_actions_per_turn: int = 1,
        render_mode: str | None = None,
    ) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode {render_mode!r} not in {self.metadata['render_modes']}")
        self.max_steps = int(max_steps)
        self.format_penalty = float(format_penalty)
        self.render_mode = render_mode
        self.parser = AnswerParser(answer_pattern, answer_format, action_separator, int(max_actions_per_turn))
        self.observation_space = spaces.Text(TEXT_MAX_LENGTH, min_length=0, charset=TEXT_CHARSET)
        self.action_space = spaces.Text(TEXT_MAX_LENGTH, min_length=0, charset=TEXT_CHARSET)
        self.turns = 0

    # ---- hooks for subclasses -------------------------------------------------------------------------
    def system_prompt(self) -> str:
        """Instructions, including the answer format."""
        raise NotImplementedError

    def _new_episode(self, seed: int, options: dict[str, Any]) -> None:
        """Set up the episode for `seed` (deterministic: use random.Random(seed), never global RNGs)."""
        raise NotImplementedError

    def _observation(self) -> str:
        raise NotImplementedError

    def _canonical_action(self, text: str) -> str | None:
        """The canonical action named by `text` (case-insensitive), or None if it names no action."""
        raise NotImplementedError

    def _apply(self, action: str) -> Move:
        raise NotImplementedError

    def _is_success(self) -> bool:
        raise NotImplementedError

    def _random_move(self, rng: random.Random) -> str:
        raise NotImplementedError

    def _expert_move(self) -> str | None:
        """The canonical action an expert takes now; None if the env has no expert (or none from here)."""
        return None

    # ---- the contract ---------------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        # An explicit seed is the task seed itself (GRPO groups share it); otherwise draw from the seeded RNG.
        episode_seed = int(seed) if seed is not None else int(self.np_random.integers(2**31 - 1))
        self.turns = 0
        self._new_episode(episode_seed, dict(options or {}))
        return self._observation(), {"seed": episode_seed}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if not isinstance(action, str):
            raise TypeError(f"{type(self).__name__}.step expects model output text, got {type(action).__name__}")
        parsed = self.parser.parse(action)
        moves = [self._canonical_action(a) for a in parsed] if parsed else []
        valid = bool(moves) and all(m is not None for m in moves)
        reward, effective, terminated, done_moves = 0.0, False, False, []
        if not valid:
            reward = self.format_penalty + self.step_penalty
        else:
            for move in moves:
                outcome = self._apply(move)  # type: ignore[arg-type]
                done_moves.append(move)
                reward += self.step_penalty + outcome.reward
                effective = effective or outcome.effective
                if outcome.terminated:
                    terminated = True
                    break
        self.turns += 1
        truncated = not terminated and self.turns >= self.max_steps
        metrics = {
            "success": float(self._is_success()),
            "action_is_valid": float(valid),
            "action_is_effective": float(effective),
        }
        info = {"metrics": metrics, "actions": done_moves}
        return self._observation(), round(reward, 9), terminated, truncated, info

    def expert_action(self) -> str | None:
        """Full model output an expert would emit now (e.g. "<answer>Up</answer>"); None without an expert."""
        move = self._expert_move()
        return None if move is None else self.parser.format([move])

    def random_action(self, rng: random.Random) -> str:
        """Model output of a uniformly random (valid-format) agent."""
        return self.parser.format([self._random_move(rng)])

    def render(self) -> str | None:
        return self._observation() if self.render_mode == "ansi" else None

    def tokenizer_corpus(self, num_episodes: int, seed: int) -> list[str]:
        """Texts this env produces (prompt, observations, answers), to train a tokenizer. Resets this env.

        Even episodes follow the expert (when there is one), odd ones act randomly: cheap, and covers both.
        """
        rng = random.Random(seed)
        texts = [self.system_prompt()]
        for episode in range(num_episodes):
            obs, _ = self.reset(seed=seed + episode)
            texts.append(obs)
            for _ in range(self.max_steps):
                action = self.expert_action() if episode % 2 == 0 else None
                action = action if action is not None else self.random_action(rng)
                obs, _, terminated, truncated, _ = self.step(action)
                texts += [action, obs]
                if terminated or truncated:
                    break
        return texts
