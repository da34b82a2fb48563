"""Finished episodes -> training samples: one per episode (trajectory-wise) or one per turn (turn-wise); and
-> the record a person reads (`episode_record`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agentrl.types import Episode, EpisodeRecord, Sample


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
        **{f"timing/episode_{k}": v for k, v in ep.timings.items()},
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


def episode_record(
    ep: Episode, tag: str, split: str, seed: int, episode_return: float, parse: Callable[[str], list] | None
) -> EpisodeRecord:
    """The episode as RUN_DIR/episodes keeps it. Assistant messages are linked to their model turns in order (a
    gateway agent that rewrote its history has more turns than its last chat shows: then no links); an env loop's
    tool calls are parsed from the text with `parse` (a gateway agent's come structured)."""
    turns = [
        {
            "token_ids": list(t.token_ids),
            "versions": list(t.versions),
            "reward": t.reward,
            "done": i == len(ep.turns) - 1,
            "resumes": t.resumes,
            "tool_calls": t.tool_calls,
        }
        for i, t in enumerate(ep.turns)
    ]
    replies = [i for i, m in enumerate(ep.messages) if m.get("role") == "assistant"]
    linked = dict(zip(replies, range(len(turns)), strict=True)) if len(replies) == len(turns) else {}
    messages: list[dict[str, Any]] = []
    for i, message in enumerate(ep.messages):
        shown = {k: v for k, v in message.items() if k in ("role", "content", "name", "tool_calls", "tool_call_id")}
        if i in linked:
            shown["turn"] = linked[i]
            if parse is not None and "tool_calls" not in shown and turns[linked[i]]["tool_calls"]:
                shown["tool_calls"] = [_call(c) for c in parse(str(message.get("content") or ""))]
        messages.append(shown)
    return EpisodeRecord(
        episode_id=ep.episode_id,
        env_id=ep.env_id,
        tag=tag,
        split=split,
        seed=seed,
        episode_return=episode_return,
        env_return=ep.env_return,
        metrics=dict(ep.metrics),
        truncation=ep.truncation,
        messages=messages,
        turns=turns,
    )


def _call(call: Any) -> dict[str, Any]:
    """A parsed tool call as JSON data (a malformed one keeps the parser's message)."""
    if hasattr(call, "name"):
        return {"name": call.name, "arguments": call.arguments}
    return {"error": str(getattr(call, "message", call))}
