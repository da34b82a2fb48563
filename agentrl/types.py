"""Data that crosses actor boundaries: generation results and training samples.

Plain dataclasses of lists (no tensors) so they pickle cheaply through Ray and serialise to JSONL.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class SamplingParams:
    """Per-request sampling; mirrors `rollout.sampling` in the config."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False  # benchmarks and tests that need exact lengths


@dataclass
class GenOutput:
    """What an engine returns for one request. `versions` has one policy version per generated token, so a
    generation that was aborted at a weight update and resumed reads [v0, ..., v0, v1, ..., v1]."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    version: int
    versions: list[int] = field(default_factory=list)
    preempted: bool = False  # aborted by pause()/update_weights, not by the caller: safe to resume
    resumes: int = 0  # times this generation was preempted and continued on newer weights
    engine: int = -1  # index of the engine that served it (set by the router)

    def __post_init__(self) -> None:
        if not self.versions:
            self.versions = [self.version] * len(self.token_ids)


@dataclass
class Sample:
    """One training sequence: a whole episode (trajectory-wise) or one turn with its history (step-wise).

    Per-token lists are aligned with `token_ids`. `loss_mask` is 1 exactly on tokens the policy generated;
    `logprobs` and `versions` are the behaviour policy's values there (0.0 / -1 elsewhere). Samples sharing a
    `group_id` were rolled out on the same task seed and form a GRPO group.
    """

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float
    group_id: str
    episode_id: str
    step_rewards: list[float] = field(default_factory=list)
    turn_index: int | None = None
    num_turns: int = 0
    env_tag: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    truncation: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if not (len(self.loss_mask) == len(self.logprobs) == len(self.versions) == n):
            raise ValueError(
                f"sample {self.episode_id}: token_ids/loss_mask/logprobs/versions lengths differ "
                f"({n}, {len(self.loss_mask)}, {len(self.logprobs)}, {len(self.versions)})"
            )

    @property
    def num_model_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def policy_versions(self) -> set[int]:
        return {v for v, m in zip(self.versions, self.loss_mask, strict=True) if m}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
