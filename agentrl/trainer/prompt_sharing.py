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
    """SDPA: tree rows each holding a few distinct contexts' tails back to back, then the suffixes of their rows
    (every row's suffix sits in the last `span` columns, where the logits are kept), each suffix seeing its own
    context and itself only (a tree mask). No row copies a context's KV cache: on a step-wise batch that copy
    (and its gradient) cost more than the model; and packing several contexts per tree row leaves little
    padding (one context per tree row padded a Sokoban batch's tree rows by 60%)."""
    n, ctx, ctx_mask = plan.prefix, plan.contexts, plan.context_mask
    dev = suffix.device
    lengths = suffix_mask.sum(dim=1)
    ctx_len = (ctx_mask.sum(dim=1) - n).clamp(min=0)
    layout = _tree_layout(plan.inverse.tolist(), lengths.tolist(), ctx_len.tolist(), n)
    trees, cw, span = layout.trees, layout.context_width, layout.span
    seg_tree, seg_ctx, seg_col = (torch.tensor(v, device=dev) for v in zip(*layout.segments, strict=True))
    tree_of, start = torch.tensor(layout.tree_of, device=dev), torch.tensor(layout.start, device=dev)
    segment_of = torch.tensor(layout.segment_of, device=dev)
    tokens = torch.zeros(trees, cw + span, dtype=suffix.dtype, device=dev)
    pos = torch.zeros_like(tokens)
    seg = torch.full((trees, cw + span), -2, device=dev)  # segment of each column (-2: padding)
    role = torch.full((trees, cw + span), -2, device=dev)  # -1: a context's token, r: row r's suffix
    # The contexts' tails: segment k's context at columns seg_col[k].. of tree row seg_tree[k].
    tail = int(ctx_len.max()) if ctx_len.numel() else 0
    j = _arange(0, tail, ctx)[None]
    ok = j < ctx_len[seg_ctx][:, None]
    t_idx = seg_tree[:, None].expand(-1, tail)[ok]
    c_idx = (seg_col[:, None] + j)[ok]
    tokens[t_idx, c_idx] = ctx[:, n : n + tail][seg_ctx][ok]
    pos[t_idx, c_idx] = (n + j).expand(len(layout.segments), -1)[ok]
    seg[t_idx, c_idx] = _arange(0, len(layout.segments), ctx)[:, None].expand(-1, tail)[ok]
    role[t_idx, c_idx] = -1
    # The rows' suffixes: row r at column cw + start[r].. of tree row tree_of[r].
    width = suffix.shape[1]
    j = _arange(0, width, suffix)[None].expand(suffix.shape[0], -1)
    t_idx = tree_of[:, None].expand(-1, width)[suffix_mask]
    c_idx = (cw + start[:, None] + j)[suffix_mask]
    tokens[t_idx, c_idx] = suffix[suffix_mask]
    pos[t_idx, c_idx] = (plan.cuts[:, None] + j)[suffix_mask]
    seg[t_idx, c_idx] = segment_of[:, None].expand(-1, width)[suffix_mask]
    role[t_idx, c_idx] = _arange(0, suffix.shape[0], suffix)[:, None].expand(-1, width)[suffix_mask]
    col = _arange(0, cw + span, suffix)
    causal = col[None, :] <= col[:, None]
    same = (seg[:, None, :] == seg[:, :, None]) & (seg[:, :, None] >= 0)
    sees = same & ((role[:, None, :] == -1) | (role[:, None, :] == role[:, :, None]))
    attend = (sees & causal[None]) | torch.eye(cw + span, dtype=torch.bool, device=dev)[None]
    cache, ties = _prefix_cache(model, plan, trees)
    if cache is not None:
        attend = torch.cat([attend.new_ones(trees, cw + span, n), attend], dim=2)
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


TREE_ATTENTION_COST = 1 / 1024  # one (query, key) pair of attention, in units of one token through the model


@dataclass
class TreeLayout:
    trees: int  # tree rows
    segments: list[tuple[int, int, int]]  # per segment (a context and some of its rows): tree row, context, column
    segment_of: list[int]  # per row: its segment
    tree_of: list[int]  # per row: its tree row
    start: list[int]  # per row: where its suffix starts in its tree row's suffix columns
    context_width: int  # context columns per tree row (the fullest one's)
    span: int  # suffix columns per tree row (the fullest one's)


def _tree_layout(inverse: list[int], lengths: list[int], ctx_len: list[int], prefix: int) -> TreeLayout:
    """The rows laid out over 1, 2, 4, ... tree rows, the cheapest by a token-count model: fewer, longer tree rows
    run each context fewer times, but attention grows with the square of a row's length. The search stops once
    there are as many tree rows as contexts and the cost grows."""
    contexts = len(set(inverse))
    best, best_cost, trees = None, float("inf"), 1
    while True:
        layout = _pack(inverse, lengths, ctx_len, trees)
        length = layout.context_width + layout.span
        cost = layout.trees * length * (1 + (prefix + length) * TREE_ATTENTION_COST)
        if cost < best_cost:
            best, best_cost = layout, cost
        elif trees >= contexts:
            return best
        if trees >= len(inverse):
            return best
        trees *= 2


def _pack(inverse: list[int], lengths: list[int], ctx_len: list[int], trees: int) -> TreeLayout:
    """Segments (a context and its rows, split where they hold more than a tree row's share of the answers),
    largest first, each into the tree row it widens least (the least filled among equals)."""
    share = max(max(lengths), -(-sum(lengths) // trees))
    segments: list[tuple[int, list[int], int]] = []  # context, rows, suffix tokens
    open_segment: dict[int, int] = {}  # context -> its segment being filled
    for r, (u, n) in enumerate(zip(inverse, lengths, strict=True)):
        k = open_segment.get(u)
        if k is None or segments[k][2] + n > share:
            k = open_segment[u] = len(segments)
            segments.append((u, [], 0))
        segments[k][1].append(r)
        segments[k] = (u, segments[k][1], segments[k][2] + n)
    fill = [[0, 0] for _ in range(min(trees, len(segments)))]  # per tree row: context and suffix columns used
    widest = [0, 0]
    placed: list[tuple[int, int, int]] = [(0, 0, 0)] * len(segments)
    segment_of, tree_of, start = [0] * len(inverse), [0] * len(inverse), [0] * len(inverse)
    for k in sorted(range(len(segments)), key=lambda k: (-ctx_len[segments[k][0]] - segments[k][2], k)):
        u, rows, size = segments[k]
        t = min(
            range(len(fill)),
            key=lambda t: (
                max(widest[0], fill[t][0] + ctx_len[u]) + max(widest[1], fill[t][1] + size),
                fill[t][0] + fill[t][1],
                t,
            ),
        )
        placed[k] = (t, u, fill[t][0])
        at = fill[t][1]
        for r in rows:
            segment_of[r], tree_of[r], start[r] = k, t, at
            at += lengths[r]
        fill[t] = [fill[t][0] + ctx_len[u], at]
        widest = [max(widest[0], fill[t][0]), max(widest[1], at)]
    return TreeLayout(len(fill), placed, segment_of, tree_of, start, widest[0], widest[1])


def _arange(start: int, end: int, like: torch.Tensor) -> torch.Tensor:
    return torch.arange(start, end, device=like.device)
