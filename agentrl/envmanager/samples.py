"""Finished episodes -> training samples: one per episode (trajectory-wise) or one per turn (step-wise)."""

from __future__ import annotations

from agentrl.types import Episode, Sample


def episode_metrics(ep: Episode, episode_return: float) -> dict[str, float]:
    """What a step logs per episode: the env's own metrics, the scored return, turns, tokens, time per part."""
    return {
        **ep.metrics,
        "return": episode_return,
        "env_return": ep.env_return,
        "turns": float(len(ep.turns)),
        "length": float(sum(len(t.token_ids) for t in ep.turns)),
        "tool_calls": float(ep.tool_calls),
        "resumes": float(sum(t.resumes for t in ep.turns)),
        **{f"time/{k}": v for k, v in ep.timings.items()},
    }


def to_samples(ep: Episode, episode_return: float, mode: str) -> list[Sample]:
    common = dict(
        reward=episode_return,
        group_id=ep.group_id,
        episode_id=ep.episode_id,
        step_rewards=[t.reward for t in ep.turns],
    )
    if mode == "trajectory":  # the episode, then the segments a gateway agent branched off (each its own sample)
        return [
            Sample(list(seq.token_ids), list(seq.loss_mask), list(seq.logprobs), list(seq.versions), **common)
            for seq in (ep, *ep.branches)
        ]
    samples = []
    for i, turn in enumerate(ep.turns):
        n_prompt = len(turn.prompt_ids)
        samples.append(
            Sample(
                turn.prompt_ids + turn.token_ids,
                [0] * n_prompt + [1] * len(turn.token_ids),
                [0.0] * n_prompt + turn.logprobs,
                [-1] * n_prompt + turn.versions,
                turn_index=i,
                **common,
            )
        )
    return samples
