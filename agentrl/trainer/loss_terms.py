"""One micro-batch's loss, assembled from `losses` by the algorithm's settings: the policy loss (decoupled PPO or
PPO-clip, plus KL and entropy terms), the critic's value loss and SFT's cross-entropy, each with the named sums a
step adds up over micro-batches and ranks (`RankSums`)."""

from __future__ import annotations

import torch

from agentrl.config.schema import AlgorithmConfig
from agentrl.trainer import losses
from agentrl.trainer.collectives import check_device, compute_tensors

RL_SUMS = ("loss", "pg_loss", "kl", "entropy", "clipped", "dual_clipped", "tokens", "ratio", "is_weight",
           "is_truncated", "value_loss", "skipped")  # fmt: skip
SFT_SUMS = ("loss", "correct")


def token_weights(alg: AlgorithmConfig, batch: dict) -> torch.Tensor:
    """Per-token loss weights; episode_mean's come precomputed (they depend on the whole batch's episodes)."""
    mask = batch["loss_mask"]
    if "token_weight" in batch:
        return mask * batch["token_weight"]
    return losses.token_weights(mask, batch["seq_ids"], alg.loss_agg)


def rl_loss(
    alg: AlgorithmConfig, device: torch.device, batch: dict, logp: torch.Tensor, ent: torch.Tensor | None, denom: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss of one micro-batch (its share of the mini-batch's, `denom` global) and its named sums."""
    mask, seq = batch["loss_mask"], batch["seq_ids"]
    w = token_weights(alg, batch)
    check_device([logp, ent, w, *compute_tensors(batch)], device, "loss inputs")
    clip = {"clip_low": alg.clip_low, "clip_high": alg.clip_high, "dual_clip": alg.dual_clip}
    if alg.loss == "decoupled_ppo":
        pg, st = losses.decoupled_ppo_loss(
            logp, batch["prox"], batch["behav"], batch["adv"], w, denom, seq,
            is_truncation=alg.is_truncation, is_level=alg.is_level, **clip,
        )  # fmt: skip
    else:
        pg, st = losses.ppo_clip_loss(logp, batch["behav"], batch["adv"], w, denom, **clip)
    total = pg
    old = batch["ref"] if "ref" in batch else batch.get("prox", batch["behav"])
    kl_tok = losses.kl_penalty(logp, old, alg.kl_estimator)
    if "ref" in batch and not alg.kl_in_reward:
        total = total + alg.kl_coef * losses.aggregate(kl_tok, w, denom)
    if alg.entropy_coef:
        total = total - alg.entropy_coef * losses.aggregate(ent, w, denom)
    sums = {"loss": total, "pg_loss": pg, "kl": (kl_tok * mask).sum(), "entropy": (ent * mask).sum(), **st}
    check_device(sums.values(), device, "loss outputs")
    return total, sums  # sums stay on the device: RankSums copies them to the host once


def value_loss(alg: AlgorithmConfig, batch: dict, v: torch.Tensor, _ent, denom: float):
    """The critic's clipped value loss of one micro-batch."""
    loss = losses.value_loss(v, batch["old_values"], batch["returns"], token_weights(alg, batch), denom)
    return loss, {"value_loss": loss}


def sft_loss(batch: dict, logp: torch.Tensor, _ent, denom: float):
    """Cross-entropy of one micro-batch, and how many of its tokens the model already gets right."""
    w = losses.token_weights(batch["loss_mask"], batch["seq_ids"], "token_mean")
    check_device([logp, w, *compute_tensors(batch)], logp.device, "loss inputs")
    loss = losses.sft_loss(logp, w, denom)
    correct = ((logp > -0.6931) * batch["loss_mask"]).sum()  # p > 0.5: greedy-correct lower bound
    return loss, {"loss": loss, "correct": correct}
