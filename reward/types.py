"""What reward functions return (`FnOutput`), may receive (`RewardContext`), and what the pool returns
(`RewardResult`). Reward functions score an `agentrl.types.Episode`.

Plain dataclasses: they cross Ray and subprocess boundaries by pickle, cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
