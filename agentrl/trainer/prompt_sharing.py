"""Running each distinct prompt of a padded micro-batch once, its KV cache feeding every row that repeats it.

Why: step-wise samples repeat a lot. Every row starts with the same system prompt, and the episodes of a group
revisit the same states, so many rows carry the very same prompt with a different (or the same) answer: a
128-episode Sokoban batch held 1,433 turns but only 201 distinct prompts. Only the answers need a row each.

A row is cut at its first needed logit (the token before its first loss token): the *context* before the cut is
shared, the *suffix* from the cut on runs per row. Three model calls, each skipped when it would not pay:
1. the prefix every row starts with (the system prompt), once;
2. the rest of each distinct context, once per distinct context, on the prefix's KV cache;
3. every row's suffix, on its context's KV cache (rows gathered from the distinct ones).
Exact, not an approximation: the logits and every gradient equal the plain pass (gradients reach the shared
tokens through the cache), checked by tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

MIN_SHARED_TOKENS = 16  # per row: sharing saves less than this -> the extra model calls cost more than they save


@dataclass
class SharingPlan:
    prefix: int  # tokens every row starts with, run once (0: folded into the contexts)
    contexts: torch.Tensor  # [U, C] distinct contexts, right-padded
    context_mask: torch.Tensor  # [U, C]
    inverse: torch.Tensor  # [B] row -> its context
    cuts: torch.Tensor  # [B] context length of each row (where its suffix starts)


def _first_loss_columns(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per row, the column of its first loss token; its last token for a row without any."""
    mask = batch["loss_mask"] > 0
    lengths = batch["attention_mask"].sum(dim=1)
    has = mask.any(dim=1)
    first = torch.where(has, mask.float().argmax(dim=1), lengths - 1)
    return first.clamp(min=1)


def plan_sharing(batch: dict[str, torch.Tensor]) -> SharingPlan | None:
    """How to share the rows' prompts, or None when the plain pass is as cheap (one row, no loss mask, a packed
    row, or too little repeated)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    if "loss_mask" not in batch or mask.dim() != 2 or ids.shape[0] < 2:
        return None
    rows, width = ids.shape
    cuts = _first_loss_columns(batch) - 1
    lengths = mask.sum(dim=1)
    common = int((ids == ids[:1]).all(dim=0).long().cumprod(dim=0).sum())
    prefix = min(common, int(cuts.min()))
    keys = [tuple(ids[r, : int(cuts[r])].tolist()) for r in range(rows)]
    distinct = {k: u for u, k in enumerate(dict.fromkeys(keys))}
    if len(distinct) == rows:  # no prompt repeats: share only the prefix all rows start with
        cuts = torch.full_like(cuts, prefix)
        keys = [keys[0][:prefix]] * rows
        distinct = {keys[0]: 0}
    if prefix < MIN_SHARED_TOKENS:
        prefix = 0
    cost = prefix + len(distinct) * (max(len(k) for k in distinct) - prefix) + rows * int((lengths - cuts).max())
    # An empty context (a row trained from its second token) would leave its padding nothing to attend to.
    if rows * width - cost < MIN_SHARED_TOKENS * (rows - 1) or int(cuts.min()) == 0:
        return None
    width_c = max(len(k) for k in distinct)
    contexts = torch.zeros(len(distinct), width_c, dtype=ids.dtype, device=ids.device)
    context_mask = torch.zeros(len(distinct), width_c, dtype=mask.dtype, device=mask.device)
    for k, u in distinct.items():
        contexts[u, : len(k)] = torch.tensor(k, dtype=ids.dtype)
        context_mask[u, : len(k)] = 1
    inverse = torch.tensor([distinct[k] for k in keys], device=ids.device)
    return SharingPlan(prefix, contexts, context_mask, inverse, cuts.to(ids.device))


def shared_logits(model: nn.Module, batch: dict[str, torch.Tensor], positions: torch.Tensor, plan: SharingPlan):
    """Logits [rows, len(positions), vocab] at `positions` of each row, as the plain pass would give them at every
    position a row needs (at or after its cut); zeros where a row needs none (before its cut, past its end)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    n = plan.prefix
    ctx, ctx_mask = plan.contexts, plan.context_mask
    graph_ties = []  # every call's output joins the graph: FSDP2 unshards a layer for backward from its output
    cache = None
    if n:
        head = model(input_ids=ctx[:1, :n], position_ids=_arange(0, n, ids)[None], use_cache=True, logits_to_keep=1)
        cache = head.past_key_values
        cache.batch_repeat_interleave(ctx.shape[0])
        graph_ties.append(head.logits)
    if ctx.shape[1] > n:
        mid = model(
            input_ids=ctx[:, n:],
            attention_mask=ctx_mask,
            position_ids=_arange(n, ctx.shape[1], ids)[None].expand(ctx.shape[0], -1),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        cache = mid.past_key_values
        graph_ties.append(mid.logits)
    cache.batch_select_indices(plan.inverse)

    lengths = mask.sum(dim=1)
    suffix_len = lengths - plan.cuts
    width = int(suffix_len.max())
    offsets = _arange(0, width, ids)[None]
    cols = (plan.cuts[:, None] + offsets).clamp(max=ids.shape[1] - 1)
    suffix_mask = (offsets < suffix_len[:, None]).to(mask.dtype)
    suffix = ids.gather(1, cols) * suffix_mask
    rel = positions[None, :] - plan.cuts[:, None]  # [rows, K]: each needed position in the row's suffix
    valid = (rel >= 0) & (rel < suffix_len[:, None])
    keep = torch.unique(rel[valid]) if bool(valid.any()) else rel.new_zeros(1)
    out = model(
        input_ids=suffix,
        attention_mask=torch.cat([ctx_mask[plan.inverse], suffix_mask], dim=1),
        position_ids=plan.cuts[:, None] + offsets,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=keep,
    )
    where = torch.searchsorted(keep, rel.clamp(min=0)).clamp(max=keep.numel() - 1)
    logits = out.logits.gather(1, where[..., None].expand(-1, -1, out.logits.shape[-1]))
    logits = torch.where(valid[..., None], logits, logits.new_zeros(()))
    return logits + 0.0 * sum(t.sum() for t in graph_ties) if graph_ties else logits


def _arange(start: int, end: int, like: torch.Tensor) -> torch.Tensor:
    return torch.arange(start, end, device=like.device)
