"""Finished episodes -> training samples: one per episode (trajectory-wise) or one per turn (step-wise)."""

from __future__ import annotations

from agentrl.envmanager.episode import EpisodeResult
from agentrl.types import Sample


def episode_metrics(ep: EpisodeResult, episode_return: float) -> dict[str, float]:
    return {
        **ep.metrics,
        "return": episode_return,
        "env_return": ep.env_return,
        "turns": float(len(ep.turns)),
        "length": float(sum(len(t.token_ids) for t in ep.turns)),
        "tool_calls": float(ep.tool_calls),
        "resumes": float(sum(t.resumes for t in ep.turns)),
    }


def to_samples(ep: EpisodeResult, episode_return: float, mode: str) -> list[Sample]:
    spec = ep.spec
    step_rewards = [t.reward for t in ep.turns]
    common = dict(
        reward=episode_return,
        group_id=spec.group_id,
        episode_id=spec.episode_id,
        step_rewards=step_rewards,
        num_turns=len(ep.turns),
        env_tag=spec.tag,
        metrics=episode_metrics(ep, episode_return),
        truncation=ep.truncation,
        timings=dict(ep.timings),
    )
    if mode == "trajectory":
        return [Sample(list(ep.token_ids), list(ep.loss_mask), list(ep.logprobs), list(ep.versions), **common)]
    samples = []
    for i, turn in enumerate(ep.turns):
        n_prompt, n_gen = len(turn.prompt_ids), len(turn.token_ids)
        samples.append(
            Sample(
                turn.prompt_ids + turn.token_ids,
                [0] * n_prompt + [1] * n_gen,
                [0.0] * n_prompt + turn.logprobs,
                [-1] * n_prompt + turn.versions,
                turn_index=i,
                **common,
            )
        )
    return samples
