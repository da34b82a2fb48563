"""Turn model output text into action strings: the env, not the env manager, owns this (the manager is generic).

One small class so every env parses the same way and the answer format is configurable in one place.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_ANSWER_PATTERN = r"<answer>(.*?)</answer>"
DEFAULT_ANSWER_FORMAT = "<answer>{}</answer>"
DEFAULT_SEPARATOR = "||"


@dataclass(frozen=True)
class AnswerParser:
    """Extracts the action text(s) from model output.

    `pattern` has one capture group holding the answer and is matched case-insensitively (the last match
    wins, so a model may quote the format while thinking). With `max_actions > 1` the answer is split on
    `separator` and at most `max_actions` actions are kept. `answer_format` writes actions back as model
    output (experts, random agents, tokenizer corpora); it must round-trip through `pattern`.
    """

    pattern: str = DEFAULT_ANSWER_PATTERN
    answer_format: str = DEFAULT_ANSWER_FORMAT
    separator: str = DEFAULT_SEPARATOR
    max_actions: int = 1

    def __post_init__(self) -> None:
        if self.max_actions < 1:
            raise ValueError(f"max_actions_per_turn must be >= 1, got {self.max_actions}")
        regex = re.compile(self.pattern, re.IGNORECASE | re.DOTALL)
        if regex.groups < 1:
            raise ValueError(f"answer_pattern {self.pattern!r} needs a capture group for the answer")
        object.__setattr__(self, "_regex", regex)
        probe = self.parse(self.format(["probe"]))
        if probe != ["probe"]:
            raise ValueError(
                f"answer_format {self.answer_format!r} does not round-trip through answer_pattern {self.pattern!r}"
            )

    def parse(self, text: str) -> list[str] | None:
        """The stripped action strings, or None when the output has no (non-empty) answer."""
        matches = self._regex.findall(text)  # type: ignore[attr-defined]
        if not matches:
            return None
        last = matches[-1]
        answer = (last[0] if isinstance(last, tuple) else last).strip()
        parts = answer.split(self.separator) if self.max_actions > 1 else [answer]
        actions = [p.strip() for p in parts if p.strip()]
        return actions[: self.max_actions] or None

    def format(self, actions: list[str]) -> str:
        """Model output that would parse to `actions`."""
        joiner = f" {self.separator} " if len(actions) > 1 else ""
        return self.answer_format.format(joiner.join(actions))
