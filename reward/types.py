"""What a reward function sees (`Episode`) and what the pool returns (`RewardResult`).

Plain dataclasses: they cross Ray and subprocess boundaries by pickle, cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Episode:
    """A finished episode as reward functions see it.

    `messages` is the chat (system/user/assistant/tool dicts with "role" and "content"); `final_answer` is the
    last assistant message's text when the env manager does not set it; `task` holds task metadata such as
    `ground_truth`; `num_model_tokens` / `max_model_tokens` feed length penalties.
    """

    messages: list[dict[str, Any]] = field(default_factory=list)
    final_answer: str | None = None
    env_id: str = ""
    env_info: dict[str, Any] = field(default_factory=dict)
    task: dict[str, Any] = field(default_factory=dict)
    num_model_tokens: int = 0
    max_model_tokens: int = 0
    episode_id: str = ""

    def __post_init__(self) -> None:
        if self.final_answer is None:
            for message in reversed(self.messages):
                if message.get("role") == "assistant":
                    self.final_answer = str(message.get("content") or "")
                    break

    @property
    def ground_truth(self) -> Any:
        return self.task.get("ground_truth", self.task.get("answer"))


@dataclass
class RewardResult:
    """The weighted score of one episode.

    `score` is None when any configured function is missing (it failed or timed out): the caller counts and
    drops it instead of training on a silent zero. `components` holds each function's unweighted score by
    name; `missing` maps a function name to why it has no score ("timeout after 2s", "error: ValueError: ...").
    """

    score: float | None
    components: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    episode_id: str = ""

    @property
    def ok(self) -> bool:
        return self.score is not None


@dataclass
class FnOutput:
    """A reward function may return a plain float, or this to add metrics (logged as reward/<name>/<key>)."""

    score: float
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class RewardContext:
    """Handles a reward function may need besides the episode (passed when it takes a `context` parameter)."""

    judge_router: Any = None  # a Router actor handle, for model-as-judge rewards
    extra: dict[str, Any] = field(default_factory=dict)
