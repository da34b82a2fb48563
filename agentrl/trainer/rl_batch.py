"""An RL step's batch, as pure functions of its samples: the shaped advantages (KL in the reward, GAE, per-turn
returns or group-relative), the per-episode token weights, the split into mini-batches of whole groups, and the
step's metric summary. The trainer rank (`agentrl.trainer.worker`) runs them; nothing here touches a model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from agentrl.config.schema import AlgorithmConfig
from agentrl.trainer import advantages as adv_lib
from agentrl.types import Sample


@dataclass
class RLBatch:
    """What all optimizer steps of one train_step share, computed once before the first of them."""

    samples: list[Sample]
    mine: list[int]  # this rank's shard of the batch
    fields: dict[str, dict[int, list[float]]]  # per-token loss inputs of this rank's samples, by sample index
    model_tokens: list[int]  # per sample: tokens the loss can weigh (loss-mask tokens after the first)
    episode_w: list[float] | None  # per sample, episode_mean only: 1 / model tokens of its episode
    prompts: tuple[list[int], list[tuple[int, ...]]]  # `prompts_of(samples)`, for every mini-batch's plan
    no_gradient: set[int]  # this rank's samples whose loss has no gradient (`TrainerRank._without_gradient`)


def prompts_of(samples: list[Sample]) -> tuple[list[int], list[tuple[int, ...]]]:
    """Per sample, its prompt's rank in sorted order (equal prompts, equal keys; neighbouring keys share the most
    tokens, which the trainer then runs once) and the prompt. A prompt is the tokens before the first loss
    token."""
    prompts = []
    for s in samples:
        first = s.loss_mask.index(1) if 1 in s.loss_mask else len(s.loss_mask)
        prompts.append(tuple(s.token_ids[:first]))
    rank = {p: k for k, p in enumerate(sorted(set(prompts)))}
    return [rank[p] for p in prompts], prompts


def shaped_advantages(
    alg: AlgorithmConfig,
    samples: list[Sample],
    mine: list[int],
    prox: dict[int, list[float]] | None,
    ref: dict[int, list[float]] | None,
    values: dict[int, list[float]] | None,
    gather: Callable[[dict[int, Any]], dict[int, Any]],
) -> tuple[dict[int, list[float]], dict[int, list[float]], list[float]]:
    """Per-token advantages for this rank's samples (`mine`), value targets for GAE, and the shaped rewards.

    With `kl_in_reward`, each sample's KL to the reference (its per-token sum, `gather`ed over ranks) lowers its
    reward before the group-relative estimators see it; GAE takes the penalty per token instead."""
    rewards = [s.reward for s in samples]
    token_kl: dict[int, list[float]] = {}
    if alg.kl_in_reward and ref is not None:
        cur = prox if prox is not None else {i: samples[i].logprobs for i in mine}
        for i in mine:
            m = samples[i].loss_mask
            token_kl[i] = [-alg.kl_coef * (a - b) * mk for a, b, mk in zip(cur[i], ref[i], m, strict=True)]
        kl_sum = gather({i: sum(v) for i, v in token_kl.items()})
        if alg.advantage != "gae":
            rewards = [r + kl_sum[i] for i, r in enumerate(rewards)]
    if alg.advantage == "gae":
        if values is None:
            raise ValueError("GAE needs the critic's values")
        sub = [samples[i] for i in mine]
        kl = [token_kl[i] for i in mine] if token_kl else None
        a, r = adv_lib.gae_advantages(sub, [values[i] for i in mine], alg.gamma, alg.gae_lambda, kl)
        return dict(zip(mine, a, strict=True)), dict(zip(mine, r, strict=True)), rewards
    if alg.advantage == "turn_return":
        shaped = [s if s.reward == r else replace(s, reward=r) for s, r in zip(samples, rewards, strict=True)]
        a = adv_lib.turn_return_advantages(shaped, alg.gamma)
        return {i: a[i] for i in mine}, {}, rewards
    seq = adv_lib.sequence_advantages(
        alg.advantage, rewards, [s.group_id for s in samples], [s.episode_id for s in samples]
    )
    return {i: adv_lib.spread(seq[i], samples[i].loss_mask) for i in mine}, {}, rewards


def episode_token_weights(samples: list[Sample], model_tokens: list[int]) -> list[float]:
    """episode_mean: 1 / (model tokens of the sample's episode over the whole batch), per sample."""
    per_episode: dict[str, int] = {}
    for s, n in zip(samples, model_tokens, strict=True):
        per_episode[s.episode_id] = per_episode.get(s.episode_id, 0) + n
    return [1.0 / max(per_episode[s.episode_id], 1) for s in samples]


def mini_batch_parts(samples: list[Sample], mine: list[int], parts: int, seed: int) -> list[list[int]]:
    """This rank's samples split into `parts` mini-batches (as many on every rank), whole groups to a part: a
    group's episodes share their prompts (the same task, often the same states), which the trainer then runs once.
    Groups are shuffled by `seed` (the caller seeds by the policy version, so a resumed run shuffles as the
    uninterrupted one would) and dealt to the part holding the fewest samples so far."""
    groups: dict[str, list[int]] = {}
    for i in sorted(mine):  # batch order, not the micro-batch planner's: the parts must not depend on it
        groups.setdefault(samples[i].group_id, []).append(i)
    k = max(1, min(parts, len({s.group_id for s in samples})))  # the same on every rank
    g = torch.Generator().manual_seed(seed)
    members = list(groups.values())
    out: list[list[int]] = [[] for _ in range(k)]
    for j in torch.randperm(len(members), generator=g).tolist():
        min(out, key=len).extend(members[j])
    return [sorted(p) for p in out]


def step_summary(
    alg: AlgorithmConfig,
    rl: RLBatch,
    m: dict[str, float],
    grad_norms: list[float],
    lrs: list[float],
    elapsed: float,
    with_critic: bool,
) -> dict[str, float]:
    """The step's metrics: losses per optimizer step, token statistics per trained model token (over all
    epochs)."""
    samples = rl.samples
    n_opt, tok = len(grad_norms), max(m["tokens"], 1.0)
    n_tokens = sum(len(s.token_ids) for s in samples)
    out = {
        "train/loss": m["loss"] / n_opt,
        "train/pg_loss": m["pg_loss"] / n_opt,
        "train/kl": m["kl"] / tok,
        "train/entropy": m["entropy"] / tok,
        "train/clip_frac": m["clipped"] / tok,
        "train/dual_clip_frac": m["dual_clipped"] / tok,
        "train/ratio_mean": m["ratio"] / tok,
        "train/grad_norm": sum(grad_norms) / n_opt,
        "train/lr": lrs[-1],
        "train/optimizer_steps": float(n_opt),
        "train/tokens": float(n_tokens),
        "train/model_tokens": float(sum(rl.model_tokens)),  # the whole batch's, trained or skipped
        "timing/trainer_step": elapsed,  # inside the trainer ranks (timing/train: the loop's whole wait)
        "train/tokens_per_s": n_tokens * alg.ppo_epochs / elapsed,
        "train/zero_advantage_frac": m["skipped"] / max(len(samples), 1),  # samples the optimizer skipped
    }
    if alg.loss == "decoupled_ppo":
        out["train/is_weight_mean"] = m["is_weight"] / tok
        out["train/is_truncated_frac"] = m["is_truncated"] / tok
    if with_critic:
        out["train/value_loss"] = m["value_loss"] / n_opt
    return out
