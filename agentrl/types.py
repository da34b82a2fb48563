"""The data agentrl's layers hand each other, in one place.

    rollout engine --GenOutput--> env manager --Episode--> reward workers
    env manager --Group (Samples + per-episode metrics + EpisodeRecords)--> SampleBuffer --batch of Groups-->
        trainer (Samples); a few EpisodeRecords --> RUN_DIR/episodes (agentrl.run.episode_log) --> agentrl view

Plain dataclasses of lists (no tensors): they cross Ray by pickle for every episode, so they carry only what a
later layer reads. A policy version counts trained batches everywhere (the warm-start weights are version 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from agentrl.config.schema import SamplingConfig

FinishReason = Literal["stop", "length", "abort"]
# The key of a trainer step's result under which the per-token advantages it was asked to report come back
# ({batch position: advantages}); the loop takes them out before the step's metrics are logged.
REPORTED_ADVANTAGES = "report/advantages"
Truncation = Literal["max_turns", "max_total_tokens", "env_truncated"]


def group_id_for(split: str, tag: str, seed: int) -> str:
    """Id of the episodes rolled out on one task seed (a GRPO group); also names the task in logs."""
    return f"{split}/{tag}/{seed}"


@dataclass
class GenOutput:
    """What an engine returns for one request. `versions` has one policy version per generated token, so a
    generation that was aborted at a weight update and resumed reads [v0, ..., v0, v1, ..., v1]."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    version: int
    versions: list[int] = field(default_factory=list)
    preempted: bool = False  # aborted by a weight update's drain, not by the caller: safe to resume
    resumes: int = 0  # times this generation was preempted and continued on newer weights
    engine: int = -1  # index of the engine that served it (set by the router)

    def __post_init__(self) -> None:
        if not self.versions:
            self.versions = [self.version] * len(self.token_ids)


@dataclass
class EpisodeSpec:
    """What to run: one episode of env `env_id` on task `seed`, the `index`-th try of its group.

    `max_turns` bounds model turns (tool-call turns included); None leaves the limit to the env's `max_steps`.
    With `agent` set, an agent program plays the env through the gateway (`agentrl.gateway.agents`).
    """

    env_id: str
    seed: int
    tag: str
    split: str = "train"
    index: int = 0
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    max_turns: int | None = None
    tool_sets: list[str] = field(default_factory=list)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    agent: str | None = None
    seat: int | None = None  # self-play: the seat this episode plays; each seat is a group of its own

    @property
    def group_id(self) -> str:
        base = group_id_for(self.split, self.tag, self.seed)
        return base if self.seat is None else f"{base}/seat{self.seat}"

    @property
    def episode_id(self) -> str:
        return f"{self.group_id}/{self.index}"

    def request_id(self, turn: int) -> str:
        """The engine request id of turn `turn` (a resumed generation appends its attempt number)."""
        return f"{self.episode_id}-t{turn}"


@dataclass
class Turn:
    """One model turn: what the model saw and what it produced. Turn-wise samples are built from turns."""

    prompt_ids: list[int]  # the model's context this turn (the running history in trajectory mode)
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float = 0.0  # the env's reward for this turn's action (0 for a tool-call turn)
    tool_calls: int = 0
    resumes: int = 0  # times this turn's generation was preempted by a weight update and resumed


@dataclass
class Segment:
    """A token sequence as it was rolled out: per-token lists aligned with `token_ids`. `loss_mask` is 1 on tokens
    the policy generated (their behaviour `logprobs` and policy `versions` are set there; 0.0 / -1 elsewhere)."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def append(
        self, ids: list[int], model: bool, logprobs: list[float] | None = None, versions: list[int] | None = None
    ) -> None:
        self.token_ids += ids
        self.loss_mask += [1 if model else 0] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.versions += versions if versions is not None else [-1] * len(ids)

    def prefix(self, n: int) -> Segment:
        """A new segment holding the first `n` tokens of this one."""
        return Segment(self.token_ids[:n], self.loss_mask[:n], self.logprobs[:n], self.versions[:n])

    @property
    def num_model_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class Episode(Segment):
    """A multi-turn episode as it ran: the token-exact trajectory for training (the episode is its own main
    segment), the chat for reward functions.

    `branches` are further segments of a gateway agent's episode (a history it rewrote, a turn it retried), each a
    trajectory-wise sample of its own. `task` holds task metadata from the env (such as
    `ground_truth`); `final_answer` is the last model turn's text. `error` is set when the env or a tool crashed
    or timed out: such an episode is counted, never trained on.
    """

    episode_id: str = ""
    group_id: str = ""
    env_id: str = ""
    task: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)
    final_answer: str | None = None
    turns: list[Turn] = field(default_factory=list)
    branches: list[Segment] = field(default_factory=list)
    env_return: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)  # the env's info["metrics"] after its last step
    truncation: Truncation | None = None  # None: the env terminated the episode
    timings: dict[str, float] = field(default_factory=lambda: {"llm": 0.0, "env": 0.0, "tool": 0.0})
    tool_calls: int = 0
    max_model_tokens: int = 0  # the generation budget of the turns taken (for length penalties)
    error: str | None = None

    def __post_init__(self) -> None:
        if self.final_answer is None:
            for message in reversed(self.messages):
                if message.get("role") == "assistant":
                    self.final_answer = str(message.get("content") or "")
                    break

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def ground_truth(self) -> Any:
        return self.task.get("ground_truth", self.task.get("answer"))


@dataclass
class Sample:
    """One training sequence: a whole episode (trajectory-wise) or one turn with its context (turn-wise).

    Per-token lists are aligned with `token_ids` as in `Episode`. Samples sharing a `group_id` were rolled out
    on the same task seed and form a GRPO group; samples sharing an `episode_id` are the turns of one episode
    (`turn_index` orders them; None for a trajectory-wise sample). `step_rewards` are the env's per-turn rewards,
    for per-turn returns.
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


@dataclass
class EpisodeRecord:
    """An episode as a person reads it (RUN_DIR/episodes, `agentrl view`): the chat message by message, and per
    model turn its tokens, policy versions, the env's reward and whether it ended the episode.

    Each assistant message names its model turn (`turn`) and the tool calls parsed from it (`tool_calls`: name and
    arguments); the tool results and the env's observations follow as `tool` / `user` messages (also after the
    last turn of an episode cut at its turn limit: what the model would have read next). `turns[k]` has
    `token_ids`, `versions`, `reward`, `done`, `resumes` (preempted by a weight update and resumed) and `tool_calls`
    (the count run). Plain data: it crosses Ray with its group and is written as one JSON line.
    """

    episode_id: str
    env_id: str
    tag: str
    split: str
    seed: int
    episode_return: float  # the scored return the trainer saw (env return + reward functions)
    env_return: float
    metrics: dict[str, float] = field(default_factory=dict)
    truncation: Truncation | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)

    @property
    def success(self) -> float | None:
        return self.metrics.get("success")


class EpisodeFailure(NamedTuple):
    """An episode that was dropped (its env or a tool crashed or timed out, or its env manager died)."""

    episode: str
    error: str

    def __str__(self) -> str:
        return f"{self.episode}: {self.error}"


@dataclass
class Group:
    """The unit of rollout work and of training: the episodes of one task seed, as samples.

    GRPO-style advantages need the whole group, so the buffer takes and hands out groups, not samples.
    `episode_metrics` has one dict per scored episode (return, success, turns, ...); `failures` and
    `missing_rewards` name the episodes that were dropped (a crash or timeout; a reward function that failed).
    `episodes` has one EpisodeRecord per scored episode, which the loop may write to RUN_DIR/episodes.
    """

    tag: str
    seed: int
    split: str = "train"
    samples: list[Sample] = field(default_factory=list)
    episode_metrics: list[dict[str, float]] = field(default_factory=list)
    failures: list[EpisodeFailure] = field(default_factory=list)
    missing_rewards: list[str] = field(default_factory=list)
    episodes: list[EpisodeRecord] = field(default_factory=list)
    admitted_version: int = 0  # the policy version when the buffer admitted the group
