"""Policy-gradient losses as pure tensor functions: PPO-clip (clip-higher, dual-clip), decoupled PPO with
truncated importance weights, KL estimators, entropy, value loss.

Every loss is a *weighted sum* `(per_token * weights).sum() / denom`: the trainer precomputes `weights` (the
loss mask, or mask / tokens-in-sequence) and the batch-global `denom` (tokens or sequences) for the chosen
aggregation, so that micro-batches and ranks add up to exactly the full-batch loss. Masked tokens have
weight 0 and contribute nothing. Statistics come back as sums over tokens, to be added
across micro-batches and ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")


def token_weights(mask: torch.Tensor, seq_ids: torch.Tensor, agg: str) -> torch.Tensor:
    """Per-token weights for an aggregation: mask (token_mean, seq_mean_token_sum) or mask / seq length.

    `seq_ids` numbers the sequences in the micro-batch (any value where mask is 0).
    """
    mask = mask.to(torch.float32)
    if agg in ("token_mean", "seq_mean_token_sum"):
        return mask
    if agg != "seq_mean_token_mean":
        raise ValueError(f"unknown loss aggregation {agg!r} (known: {', '.join(AGGREGATIONS)})")
    ids = torch.where(mask > 0, seq_ids, torch.zeros_like(seq_ids)).long().flatten()
    counts = torch.zeros(int(ids.max()) + 1 if ids.numel() else 1, device=mask.device)
    counts.index_add_(0, ids, mask.flatten())
    return (mask.flatten() / counts[ids].clamp(min=1)).view_as(mask) * mask


def aggregate(values: torch.Tensor, weights: torch.Tensor, denom: float) -> torch.Tensor:
    """The one reduction every loss term uses (see module docstring)."""
    return (values * weights).sum() / max(float(denom), 1e-8)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate on samples of pi: k1 = log(pi/ref); k3 = r - log r - 1, r = ref/pi."""
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r} (known: k1, k3)")


LOGIT_CHUNK_ELEMS = 1 << 24  # fp32 softmax elements alive at once (64 MiB): rows per chunk = this // vocab
GREEDY_TEMPERATURE = 1e-5  # below it engines sample greedily (vLLM's and SGLang's _SAMPLING_EPS)


@dataclass(frozen=True)
class SamplingDist:
    """The distribution the rollout engines draw a token from, the one behaviour log-probs are of (vLLM's
    processed log-probs, `agentrl.rollout.vllm_engine`): softmax(logits / temperature), and with `top_k` > 0 or
    `top_p` < 1 restricted to vLLM's kept set and renormalised. The kept set is vLLM's
    (`apply_top_k_top_p_pytorch`): the `top_k` largest scaled logits (ties at the k-th value kept), then of
    those, ascending by probability, every token after the prefix whose cumulative probability is <= 1 - top_p
    (the most likely token always stays). Temperature 1, top_p 1, top_k <= 0 is the model's own distribution."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1

    @classmethod
    def of(cls, sampling: Any) -> SamplingDist:
        """The distribution a `SamplingConfig` samples from. Greedy sampling (temperature < 1e-5) reports the
        model's own log-probs in vLLM and SGLang (no temperature, no truncation), and so does this."""
        if sampling.temperature < GREEDY_TEMPERATURE:
            return cls()
        return cls(float(sampling.temperature), float(sampling.top_p), int(sampling.top_k))

    @property
    def truncates(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0


MODEL_DIST = SamplingDist()  # the model's own distribution: SFT, and every pass before this option existed


def kept_threshold(z: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """Per row of scaled logits z [N, V]: the smallest value vLLM's top-k / top-p keeps (so the kept set is
    z >= it, up to ties at that value), or -inf when nothing is cut. The same operations as vLLM's
    `apply_top_k_top_p_pytorch` (its CPU path), in the same float32 arithmetic."""
    vocab = z.shape[-1]
    cuts_k = 0 < top_k < vocab
    if top_p >= 1.0:
        if not cuts_k:
            return z.new_full(z.shape[:-1], float("-inf"))
        return z.topk(top_k, dim=-1).values[:, -1]  # the k-th largest: ties with it stay, as in vLLM
    vals = z.sort(dim=-1).values  # ascending
    if cuts_k:
        vals = vals.masked_fill(vals < vals[:, vocab - top_k, None], float("-inf"))
    limit = 1 - torch.tensor(top_p, dtype=torch.float32, device=z.device)  # vLLM's float32 1 - p
    drop = vals.softmax(dim=-1).cumsum(dim=-1) <= limit
    drop[:, -1] = False  # the most likely token always stays
    first = drop.sum(dim=-1, keepdim=True)  # the dropped tokens are a prefix of the ascending order
    return vals.gather(-1, first).squeeze(-1)


def _scaled(logits: torch.Tensor, temperature: float, thr: torch.Tensor | None, targets: torch.Tensor | None):
    """fp32 logits / T of one chunk and, when truncating (`thr`), the kept mask: z >= thr, and each row's target
    (an off-policy token, or one on the edge of the set, would otherwise get log-prob -inf). Masked logits -inf."""
    z = logits.float() / temperature
    if thr is None:
        return z, None
    keep = z >= thr[:, None]
    if targets is not None:
        keep.scatter_(-1, targets[:, None], True)
    return z.masked_fill(~keep, float("-inf")), keep


class _ChunkedLogprobs(torch.autograd.Function):
    """log softmax(z / T)[target] and entropy per row of z [N, V], one chunk of rows at a time, both ways; with
    top-k / top-p (`SamplingDist`) over the kept set only, the rest masked to -inf.

    Autograd through a chunked log_softmax would still keep every chunk's fp32 softmax for backward (and slice
    backward adds a full-size zero gradient per chunk); here forward keeps only the logits (already alive as the
    model's output) and two numbers per row (three when truncating: the kept set's threshold), and backward
    recomputes each chunk's softmax and writes its gradient straight into one [N, V] buffer:
    d logp_t / dz = onehot_t - p,  dH / dz = -p * (log p + H), times 1 / T (0 outside the kept set, where p = 0).
    """

    @staticmethod
    def forward(ctx, logits, targets, temperature: float, rows: int, with_entropy: bool, entropy_grad: bool,
                top_p: float = 1.0, top_k: int = -1):  # fmt: skip
        n = logits.shape[0]
        logp = logits.new_empty(n, dtype=torch.float32)
        ent = logits.new_zeros(n, dtype=torch.float32)
        thr = logits.new_empty(n, dtype=torch.float32) if top_p < 1.0 or top_k > 0 else None
        for s in range(0, n, rows):
            part = slice(s, s + rows)
            tgt = targets[part] if targets is not None else None
            if thr is not None:
                thr[part] = kept_threshold(logits[part].float() / temperature, top_p, top_k)
            z, keep = _scaled(logits[part], temperature, thr[part] if thr is not None else None, tgt)
            logp_all = torch.log_softmax(z, dim=-1)
            if tgt is not None:
                logp[part] = logp_all.gather(-1, tgt[:, None]).squeeze(-1)
            if with_entropy:  # 0 * log 0 = 0 outside the kept set
                ent[part] = -(logp_all.exp() * (logp_all if keep is None else logp_all.masked_fill(~keep, 0))).sum(-1)
        ctx.save_for_backward(logits, targets, ent, thr)
        ctx.temperature, ctx.rows = temperature, rows
        ctx.set_materialize_grads(False)
        if not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, targets, ent, thr = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.rows):
            part = slice(s, s + ctx.rows)
            tgt = targets[part] if targets is not None else None
            z, keep = _scaled(logits[part], ctx.temperature, thr[part] if thr is not None else None, tgt)
            logp_all = torch.log_softmax(z, dim=-1)
            p = logp_all.exp()
            g = torch.zeros_like(p)
            if g_logp is not None and tgt is not None:
                gl = g_logp[part, None]
                g = g.scatter_add_(-1, tgt[:, None], gl) - p * gl
            if g_ent is not None:
                logp_kept = logp_all if keep is None else logp_all.masked_fill(~keep, 0)
                g -= p * (logp_kept + ent[part, None]) * g_ent[part, None]
            grad[part] = g / ctx.temperature
        return grad, None, None, None, None, None, None, None


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor | None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    chunk_elems: int | None = None,
    *,
    top_p: float = 1.0,
    top_k: int = -1,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """log softmax(logits / T)[targets] and the entropy, per position ([..., vocab] -> [...]), in fp32; with
    `top_p` < 1 or `top_k` > 0 of the truncated, renormalised distribution (`SamplingDist`; each target is kept
    in its row's set).

    The fp32 [tokens, vocab] log-softmax is never whole, forward or backward (see `_ChunkedLogprobs`). The
    entropy carries a gradient only if `entropy_grad` (an entropy bonus); otherwise it is a metric.
    """
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    tgt = targets.reshape(-1) if targets is not None else None
    rows = max(1, (chunk_elems or LOGIT_CHUNK_ELEMS) // vocab)
    logp, ent = _ChunkedLogprobs.apply(
        flat, tgt, float(temperature), rows, with_entropy, entropy_grad, float(top_p), int(top_k)
    )
    shape = logits.shape[:-1]
    return (logp.view(shape) if tgt is not None else None), (ent.view(shape) if with_entropy else None)


def is_weights(
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    truncation: float,
    level: str,
) -> torch.Tensor:
    """Truncated importance weights pi_prox / pi_behav that correct for stale (off-policy) behaviour tokens.

    token level: min(exp(prox - behav), truncation) per token. sequence level: min(prod over the sequence's
    model tokens, truncation), the same weight on every token of the sequence. No gradient flows through them.
    """
    with torch.no_grad():
        diff = (prox_logp - behav_logp) * mask
        if level == "token":
            w = torch.exp(diff)
        elif level == "sequence":
            ids = torch.where(mask > 0, seq_ids, torch.zeros_like(seq_ids)).long().flatten()
            sums = torch.zeros(int(ids.max()) + 1 if ids.numel() else 1, dtype=diff.dtype, device=diff.device)
            sums.index_add_(0, ids, diff.flatten())
            w = torch.exp(sums[ids]).view_as(diff)
        else:
            raise ValueError(f"unknown importance-weight level {level!r} (known: token, sequence)")
        return torch.clamp(w, max=truncation) * mask


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    denom: float,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    importance: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip surrogate, ratio = pi / pi_old, clipped to [1 - clip_low, 1 + clip_high] (clip-higher when
    clip_high > clip_low). Dual-clip caps the loss of negative-advantage tokens at dual_clip * |A|.
    `importance` multiplies each token's loss (decoupled PPO's behaviour correction).

    Returns (loss, sums) with sums over weighted-in tokens: clipped (the clipped branch was taken),
    dual_clipped, tokens, ratio.
    """
    ratio = torch.exp(logp - old_logp)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(loss1, loss2)
    active = (weights > 0).float()
    clipped = (loss2 > loss1).float()
    dual = torch.zeros_like(per_token)
    if dual_clip is not None:
        cap = -advantages * dual_clip
        dual = ((advantages < 0) & (per_token > cap)).float()
        per_token = torch.where(advantages < 0, torch.minimum(per_token, cap), per_token)
    if importance is not None:
        per_token = per_token * importance
    loss = aggregate(per_token, weights, denom)
    sums = {
        "clipped": (clipped * active).sum().detach(),
        "dual_clipped": (dual * active).sum().detach(),
        "tokens": active.sum().detach(),
        "ratio": (ratio * active).sum().detach(),
    }
    return loss, sums


def decoupled_ppo_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    denom: float,
    seq_ids: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    is_truncation: float = 2.0,
    is_level: str = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO (AReaL): clip against the proximal policy the trainer recomputed, and reweight by the
    truncated pi_prox / pi_behav so that tokens sampled by an older policy version stay unbiased. On on-policy
    data (prox == behav) it equals `ppo_clip_loss`.
    """
    mask = (weights > 0).float()
    w = is_weights(prox_logp, behav_logp, mask, seq_ids, is_truncation, is_level)
    loss, sums = ppo_clip_loss(
        logp, prox_logp, advantages, weights, denom, clip_low, clip_high, dual_clip, importance=w
    )
    sums["is_weight"] = w.sum()
    sums["is_truncated"] = ((torch.exp((prox_logp - behav_logp) * mask) > is_truncation).float() * mask).sum()
    return loss, sums


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    weights: torch.Tensor,
    denom: float,
    clip: float | None = 0.2,
) -> torch.Tensor:
    """Clipped value loss 0.5 * max((v - R)^2, (v_clip - R)^2) for the GAE critic."""
    err = (values - returns) ** 2
    if clip is not None:
        v_clip = old_values + torch.clamp(values - old_values, -clip, clip)
        err = torch.maximum(err, (v_clip - returns) ** 2)
    return 0.5 * aggregate(err, weights, denom)


def sft_loss(logp: torch.Tensor, weights: torch.Tensor, denom: float) -> torch.Tensor:
    """Cross-entropy on the weighted (loss-mask) tokens: the negative mean log-likelihood."""
    return aggregate(-logp, weights, denom)
