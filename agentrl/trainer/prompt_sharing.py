"""Running each distinct prompt of a padded micro-batch once, its KV cache feeding every row that repeats it.

Why: step-wise samples repeat a lot. Every row starts with the same system prompt, and the episodes of a group
revisit the same states, so many rows carry the very same prompt with a different (or the same) answer: a
128-episode Sokoban batch held 1,433 turns but only 201 distinct prompts. Only the answers need a row each.

A row is cut at its first needed logit (the token before its first loss token): the *context* before the cut is
shared, the *suffix* from the cut on runs per row. The prefix every row starts with (the system prompt) runs
once; then, with SDPA, one call where each tree row holds a distinct context's tail and its rows' suffixes side by
side under a tree mask (each suffix sees the context and itself). Flash kernels take no such mask: there the
distinct contexts run once and every row's suffix runs on a copy of its context's KV cache (two calls).
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
    lengths = mask.sum(dim=1)
    suffix_len = lengths - plan.cuts
    width = int(suffix_len.max())
    offsets = _arange(0, width, ids)[None]
    cols = (plan.cuts[:, None] + offsets).clamp(max=ids.shape[1] - 1)
    suffix_mask = offsets < suffix_len[:, None]
    suffix = ids.gather(1, cols) * suffix_mask
    rel = positions[None, :] - plan.cuts[:, None]  # [rows, K]: each needed position in the row's suffix
    valid = (rel >= 0) & (rel < suffix_len[:, None])
    if _takes_custom_masks(model):
        logits, ties = _tree_pass(model, plan, suffix, suffix_mask, rel.clamp(0, width - 1))
    else:
        logits, ties = _row_pass(model, plan, suffix, suffix_mask, rel, valid)
    logits = torch.where(valid[..., None], logits, logits.new_zeros(()))
    return logits + 0.0 * sum(t.sum() for t in ties) if ties else logits  # FSDP2 unshards for backward from them


def _takes_custom_masks(model: nn.Module) -> bool:
    """SDPA (and eager) attention take any [rows, 1, q, k] mask; flash kernels only padding or packed rows."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) == "sdpa"


def _prefix_cache(model: nn.Module, plan: SharingPlan, rows: int) -> tuple[object | None, list[torch.Tensor]]:
    """The KV cache of the prefix every row starts with, run once and repeated for `rows` rows (None: no prefix)."""
    n, ctx = plan.prefix, plan.contexts
    if not n:
        return None, []
    head = model(input_ids=ctx[:1, :n], position_ids=_arange(0, n, ctx)[None], use_cache=True, logits_to_keep=1)
    cache = head.past_key_values
    cache.batch_repeat_interleave(rows)
    return cache, [head.logits]


def _row_pass(model, plan, suffix, suffix_mask, rel, valid) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Flash kernels: each distinct context once, then every row's suffix on a copy of its context's KV cache."""
    n, ctx, ctx_mask = plan.prefix, plan.contexts, plan.context_mask
    cache, ties = _prefix_cache(model, plan, ctx.shape[0])
    if ctx.shape[1] > n:
        mid = model(
            input_ids=ctx[:, n:],
            attention_mask=ctx_mask,
            position_ids=_arange(n, ctx.shape[1], ctx)[None].expand(ctx.shape[0], -1),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        cache = mid.past_key_values
        ties.append(mid.logits)
    cache.batch_select_indices(plan.inverse)
    keep = torch.unique(rel[valid]) if bool(valid.any()) else rel.new_zeros(1)
    out = model(
        input_ids=suffix,
        attention_mask=torch.cat([ctx_mask[plan.inverse], suffix_mask.to(ctx_mask.dtype)], dim=1),
        position_ids=plan.cuts[:, None] + _arange(0, suffix.shape[1], suffix)[None],
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=keep,
    )
    where = torch.searchsorted(keep, rel.clamp(min=0)).clamp(max=keep.numel() - 1)
    return out.logits.gather(1, where[..., None].expand(-1, -1, out.logits.shape[-1])), ties


def _tree_pass(model, plan, suffix, suffix_mask, rel) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """SDPA: one row per distinct context (or per few of its rows) holding the context's tail and then the
    suffixes of its rows back to back, each suffix seeing the context and itself only (a tree mask). No row
    copies a context's KV cache: on a step-wise batch that copy (and its gradient) cost more than the model."""
    n, ctx, ctx_mask = plan.prefix, plan.contexts, plan.context_mask
    tail = ctx.shape[1] - n
    lengths = suffix_mask.sum(dim=1)
    layout = _tree_layout(plan.inverse.tolist(), lengths.tolist(), tail, n)
    trees, span = len(layout.tree_ctx), layout.span
    dev = suffix.device
    tree_ctx = torch.tensor(layout.tree_ctx, device=dev)
    tree_of, start = torch.tensor(layout.tree_of, device=dev), torch.tensor(layout.start, device=dev)
    # Every suffix token's place: tree row, column (after the context's tail).
    width = suffix.shape[1]
    t_idx = tree_of[:, None].expand(-1, width)[suffix_mask]
    c_idx = (tail + start[:, None] + _arange(0, width, suffix)[None]).expand(suffix.shape[0], -1)[suffix_mask]
    tokens = torch.zeros(trees, tail + span, dtype=suffix.dtype, device=dev)
    tokens[:, :tail] = ctx[tree_ctx, n:]
    tokens[t_idx, c_idx] = suffix[suffix_mask]
    pos = torch.zeros_like(tokens)
    pos[:, :tail] = _arange(n, n + tail, ctx)[None]
    pos[t_idx, c_idx] = (plan.cuts[:, None] + _arange(0, width, suffix)[None]).expand(suffix.shape[0], -1)[suffix_mask]
    seg = torch.full((trees, tail + span), -2, device=dev)  # -1: context, r: row r's suffix, -2: padding
    seg[:, :tail] = torch.where(ctx_mask[tree_ctx, n:] > 0, -1, -2)
    seg[t_idx, c_idx] = _arange(0, suffix.shape[0], suffix)[:, None].expand(-1, width)[suffix_mask]
    col = _arange(0, tail + span, suffix)
    causal = col[None, :] <= col[:, None]
    sees = (seg[:, None, :] == -1) | ((seg[:, None, :] == seg[:, :, None]) & (seg[:, :, None] >= 0))
    attend = (sees & causal[None]) | torch.eye(tail + span, dtype=torch.bool, device=dev)[None]
    cache, ties = _prefix_cache(model, plan, trees)
    if cache is not None:
        attend = torch.cat([attend.new_ones(trees, tail + span, n), attend], dim=2)
    out = model(
        input_ids=tokens,
        attention_mask=attend[:, None],
        position_ids=pos,
        past_key_values=cache,
        use_cache=cache is not None,
        logits_to_keep=span,
    )
    flat = out.logits.reshape(trees * span, -1)
    rel = torch.minimum(rel, lengths[:, None] - 1)  # positions a row does not need read its own last logit
    where = tree_of[:, None] * span + start[:, None] + rel  # [rows, K]: each needed logit in `flat`
    return flat[where], ties


TREE_ATTENTION_COST = 1 / 256  # one (query, key) pair of attention, in units of one token through the model


@dataclass
class TreeLayout:
    tree_ctx: list[int]  # per tree row: its context
    tree_of: list[int]  # per row: its tree row
    start: list[int]  # per row: where its suffix starts after the tree row's context tail
    span: int  # suffix columns per tree row (the fullest one's)


def _tree_layout(inverse: list[int], lengths: list[int], tail: int, prefix: int) -> TreeLayout:
    """Rows of one context fill its tree rows up to a suffix budget. A larger budget runs each context's tail
    fewer times, but every tree row pads to the fullest and attention grows with the square of its length: the
    budget (a power of two times the longest suffix) is the cheapest by a token-count model."""
    best, best_cost, budget = None, float("inf"), max(lengths)
    while True:
        layout = _fill_trees(inverse, lengths, budget)
        length = tail + layout.span
        cost = len(layout.tree_ctx) * length * (1 + (prefix + length) * TREE_ATTENTION_COST)
        if cost < best_cost:
            best, best_cost = layout, cost
        if len(layout.tree_ctx) == len(set(inverse)):  # one tree row per context: a larger budget changes nothing
            return best
        budget *= 2


def _fill_trees(inverse: list[int], lengths: list[int], budget: int) -> TreeLayout:
    tree_ctx: list[int] = []
    tree_of, start = [0] * len(inverse), [0] * len(inverse)
    open_tree: dict[int, tuple[int, int]] = {}  # context -> (its tree row being filled, columns used)
    for r, (u, n) in enumerate(zip(inverse, lengths, strict=True)):
        t, used = open_tree.get(u, (-1, budget))
        if used + n > budget:
            t, used = len(tree_ctx), 0
            tree_ctx.append(u)
        tree_of[r], start[r] = t, used
        open_tree[u] = (t, used + n)
    return TreeLayout(tree_ctx, tree_of, start, max(s + n for s, n in zip(start, lengths, strict=True)))


def _arange(start: int, end: int, like: torch.Tensor) -> torch.Tensor:
    return torch.arange(start, end, device=like.device)
