"""Running each distinct prompt of a padded micro-batch once, its KV cache feeding every row that repeats it.

Why: turn-wise samples repeat a lot. Every row starts with the same system prompt, the episodes of a group
revisit the same states, so many rows carry the very same prompt with a different (or the same) answer, and
distinct prompts of one level differ only in their last lines: a 128-episode Sokoban batch held 1,554 turns,
706 distinct prompts, and after the system prompt 29k distinct tokens that a trie holds in 10k.

A row is cut at its first needed logit (the token before its first loss token): the *context* before the cut is
shared, the *suffix* from the cut on runs per row. The prefix every row starts with (the system prompt) runs
once; then, with SDPA, one call where each tree row holds a trie of some distinct contexts' tails and then their
rows' suffixes, under a tree mask (each token sees its path in the trie, each suffix its context and itself).
Flash kernels take no such mask: there the distinct contexts run once and every row's suffix runs on a copy of
its context's KV cache (two calls).
Exact, not an approximation: the logits and every gradient equal the plain pass (gradients reach the shared
tokens through the cache), checked by tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from agentrl.trainer.batching import shared_prefix
from agentrl.trainer.varlen_attention import takes_dense_masks

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


def model_calls(model: nn.Module, plan: SharingPlan | None) -> int:
    """Which model calls `shared_logits` makes for `plan`, as a code (0: the plain pass's single call). FSDP2 ranks
    must make the same calls for a micro-batch: each call all-gathers every layer's parameters, and the
    collectives of two ranks pair up one by one."""
    if plan is None:
        return 0
    prefix = int(plan.prefix > 0)
    if _takes_custom_masks(model):
        return 1 + prefix  # [prefix], tree
    return 3 + prefix + 2 * int(plan.contexts.shape[1] > plan.prefix)  # [prefix], [contexts], suffixes


def _takes_custom_masks(model: nn.Module) -> bool:
    """SDPA (and agentrl's varlen attention, through SDPA) take any [rows, 1, q, k] mask; flash kernels only
    padding or packed rows."""
    config = getattr(model, "config", None)
    return takes_dense_masks(getattr(config, "_attn_implementation", None) or "")


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
    """SDPA: tree rows each holding a trie of some distinct contexts' tails (a token shared by several contexts
    runs once), then their rows' suffixes in the last columns (where the logits are kept); under a tree mask a
    token sees its ancestors in the trie, a suffix its context's path and itself. Turn-wise prompts that differ
    only in the last lines (a grid's lower rows, a "(visit k)" mark) share the rest: on a Sokoban batch the
    distinct contexts' 29k tail tokens were a trie of 10k. No row copies a context's KV cache."""
    n, ctx, ctx_mask = plan.prefix, plan.contexts, plan.context_mask
    dev = suffix.device
    lengths = suffix_mask.sum(dim=1)
    ctx_len = (ctx_mask.sum(dim=1) - n).clamp(min=0).tolist()
    tails = [tuple(row[n : n + k]) for row, k in zip(ctx.tolist(), ctx_len, strict=True)]
    layout = _tree_layout(tails, plan.inverse.tolist(), lengths.tolist(), n)
    trees, width, span = layout.trees, layout.width, layout.span
    tokens = torch.tensor(layout.tokens, dtype=suffix.dtype, device=dev)
    pos = torch.tensor(layout.positions, device=dev)
    lo, hi, me = (torch.tensor(v, device=dev) for v in (layout.lo, layout.hi, layout.me))
    owner = torch.full((trees, width), -2, device=dev)  # r: row r's suffix, -1: a trie token, -2: padding
    owner[lo >= 0] = -1
    tree_of, start = torch.tensor(layout.tree_of, device=dev), torch.tensor(layout.start, device=dev)
    j = _arange(0, suffix.shape[1], suffix)[None].expand(suffix.shape[0], -1)
    t_idx = tree_of[:, None].expand_as(j)[suffix_mask]
    c_idx = (start[:, None] + j)[suffix_mask]
    tokens[t_idx, c_idx] = suffix[suffix_mask]
    pos[t_idx, c_idx] = (plan.cuts[:, None] + j)[suffix_mask]
    owner[t_idx, c_idx] = _arange(0, suffix.shape[0], suffix)[:, None].expand_as(j)[suffix_mask]
    me[t_idx, c_idx] = torch.tensor(layout.context_end, device=dev)[:, None].expand_as(j)[suffix_mask]
    col = _arange(0, width, suffix)
    # query q sees key k: k is on q's trie path (k's subtree [lo, hi] holds q's place `me`), or both are one row's
    # suffix and k comes first
    in_trie = (lo[:, None, :] <= me[:, :, None]) & (me[:, :, None] <= hi[:, None, :]) & (lo[:, None, :] >= 0)
    same_row = (owner[:, None, :] == owner[:, :, None]) & (owner[:, :, None] >= 0) & (col[None, :] <= col[:, None])
    attend = in_trie | same_row | torch.eye(width, dtype=torch.bool, device=dev)[None]
    cache, ties = _prefix_cache(model, plan, trees)
    if cache is not None:
        attend = torch.cat([attend.new_ones(trees, width, n), attend], dim=2)
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
    where = tree_of[:, None] * span + (start[:, None] - (width - span)) + rel  # [rows, K]: each logit in `flat`
    return flat[where], ties


TREE_ATTENTION_COST = 1 / 256  # one (query, key) pair of attention, in units of one token through the model


@dataclass
class TreeLayout:
    """Tree rows of `width` columns: trie tokens from column 0, each tree row's suffixes in its last columns."""

    trees: int
    width: int
    span: int  # the most suffix columns of any tree row: the logits kept
    tokens: list[list[int]]  # [trees][width] trie tokens (0 elsewhere; the suffixes are filled in on the device)
    positions: list[list[int]]
    lo: list[list[int]]  # per trie token: its column and the last column of its subtree (-1 elsewhere)
    hi: list[list[int]]
    me: list[list[int]]  # per trie token: its column (-1 elsewhere; a suffix's is its context_end)
    tree_of: list[int]  # per row: its tree row
    start: list[int]  # per row: the column its suffix starts at
    context_end: list[int]  # per row: the column of its context's last trie token (-1: the context is the prefix)


def _tree_layout(tails: list[tuple[int, ...]], inverse: list[int], lengths: list[int], prefix: int) -> TreeLayout:
    """Contexts in sorted order (neighbours share the most) with their rows, filled into tree rows of a width
    budget; of the budgets tried, the cheapest by a token-count model: wider tree rows share more of the trie
    and pad less, but attention grows with the square of a row's length."""
    order = sorted(range(len(tails)), key=lambda u: tails[u])
    rows_of: dict[int, list[int]] = {}
    for r, u in enumerate(inverse):
        rows_of.setdefault(u, []).append(r)
    order = [u for u in order if u in rows_of]
    biggest = max(len(tails[u]) + max(lengths[r] for r in rows_of[u]) for u in order)
    best, best_cost, budget = None, float("inf"), biggest
    while True:
        fill = _fill(tails, order, rows_of, lengths, budget)
        width = max(c + s for c, s, _ in fill)
        cost = len(fill) * width * (1 + (prefix + width) * TREE_ATTENTION_COST)
        if cost < best_cost:
            best, best_cost = fill, cost
        if len(fill) == 1:
            return _lay_out(tails, best, lengths, len(inverse), prefix)
        budget *= 2


def _fill(tails, order, rows_of, lengths, budget) -> list[tuple[int, int, list[tuple[int, list[int]]]]]:
    """Tree rows as (trie tokens, suffix tokens, [(context, its rows here)]), filled in `order` up to `budget`
    columns; a context whose rows overflow a tree row continues in the next (its path runs again there)."""
    fill: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    trie = suffixes = 0
    members: list[tuple[int, list[int]]] = []
    last: tuple[int, ...] = ()
    for u in order:
        tail = tails[u]
        new = len(tail) - shared_prefix(last, tail) if members else len(tail)
        here: list[int] = []
        for r in rows_of[u]:
            if (members or here) and trie + new + suffixes + lengths[r] > budget:
                if here:
                    members.append((u, here))
                    trie += new
                fill.append((trie, suffixes, members))
                trie = suffixes = 0
                members, here, new = [], [], len(tail)
            here.append(r)
            suffixes += lengths[r]
        members.append((u, here))
        trie += new
        last = tail
    fill.append((trie, suffixes, members))
    return fill


def _lay_out(tails, fill, lengths: list[int], rows: int, prefix: int) -> TreeLayout:
    """Each tree row's trie in depth-first order (a parent before its children, a subtree contiguous), its rows'
    suffixes right-aligned after it."""
    width = max(c + s for c, s, _ in fill)
    span = max(s for _, s, _ in fill)
    tokens, positions = [[0] * width for _ in fill], [[0] * width for _ in fill]
    lo, hi, me = ([[-1] * width for _ in fill] for _ in range(3))
    tree_of, start, context_end = [0] * rows, [0] * rows, [-1] * rows
    for t, (_, suffixes, members) in enumerate(fill):
        path: list[int] = []  # columns of the current context's tokens, by depth
        open_: list[int] = []  # columns whose subtree is still open, by depth
        col, last = 0, ()
        at = width - suffixes
        for u, here in members:
            tail = tails[u]
            keep = shared_prefix(last, tail) if path or last else 0
            keep = min(keep, len(path))
            for c in open_[keep:]:
                hi[t][c] = col - 1
            del path[keep:], open_[keep:]
            for d in range(keep, len(tail)):
                tokens[t][col], positions[t][col] = tail[d], prefix + d
                lo[t][col] = me[t][col] = col
                path.append(col)
                open_.append(col)
                col += 1
            last = tail
            end = path[len(tail) - 1] if tail else -1
            for r in here:
                tree_of[r], start[r], context_end[r] = t, at, end
                at += lengths[r]
        for c in open_:
            hi[t][c] = col - 1
    return TreeLayout(len(fill), width, span, tokens, positions, lo, hi, me, tree_of, start, context_end)


def _arange(start: int, end: int, like: torch.Tensor) -> torch.Tensor:
    return torch.arange(start, end, device=like.device)
