"""Advantage estimators: pure functions from rewards (and values) to per-token advantages.

Sequence-level estimators (GRPO, Dr.GRPO's no-std variant, RLOO, REINFORCE++) give one number per sample,
spread over its model tokens. `turn_return` gives each turn its discounted return-to-go; `gae` runs over the
model tokens of one sequence with a critic's values. Everything here is deterministic and cheap,
so every trainer rank computes the whole batch's advantages itself instead of exchanging them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from agentrl.types import Sample

EPS = 1e-6


def _group_index(group_ids: Sequence[str]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        groups[g].append(i)
    return groups


def grpo(rewards: Sequence[float], group_ids: Sequence[str], use_std: bool = True) -> list[float]:
    """(r - group mean) / (group std + eps); `use_std=False` is Dr.GRPO's unbiased variant (no std scaling).

    The std is the population std (unbiased=False) so a group of one gets advantage 0, not NaN. A group whose
    rewards are all equal gets exactly 0 (its mean may round off the common value by an ulp, which the tiny std
    would blow up to ~1e-10): the trainer skips samples whose every advantage is 0.
    """
    r = torch.tensor(rewards, dtype=torch.float64)
    out = torch.zeros_like(r)
    for idx in _group_index(group_ids).values():
        g = r[idx]
        if bool((g == g[0]).all()):
            continue
        centred = g - g.mean()
        out[idx] = centred / (g.std(unbiased=False) + EPS) if use_std else centred
    return out.tolist()


def rloo(rewards: Sequence[float], group_ids: Sequence[str]) -> list[float]:
    """Leave-one-out baseline: r_i - mean of the other rewards in the group (0 for a group of one)."""
    r = torch.tensor(rewards, dtype=torch.float64)
    out = torch.zeros_like(r)
    for idx in _group_index(group_ids).values():
        n = len(idx)
        g = r[idx]
        if n < 2 or bool((g == g[0]).all()):
            continue
        out[idx] = g - (g.sum() - g) / (n - 1)
    return out.tolist()


def reinforce_pp(rewards: Sequence[float]) -> list[float]:
    """REINFORCE++: no critic, no group baseline; rewards whitened over the whole batch."""
    r = torch.tensor(rewards, dtype=torch.float64)
    if len(r) < 2 or bool((r == r[0]).all()):
        return [0.0] * len(r)
    return ((r - r.mean()) / (r.std(unbiased=False) + EPS)).tolist()


def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """G_t = r_t + gamma * G_{t+1}: the return-to-go of every turn."""
    out = [0.0] * len(rewards)
    running = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = rewards[t] + gamma * running
        out[t] = running
    return out


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over one sequence of T steps (model tokens), terminal after the last.

    Returns (advantages, returns = advantages + values), both [T].
    """
    T = rewards.shape[0]
    adv = torch.zeros_like(rewards)
    last = torch.zeros((), dtype=rewards.dtype)
    for t in range(T - 1, -1, -1):
        next_v = values[t + 1] if t + 1 < T else torch.zeros((), dtype=values.dtype)
        delta = rewards[t] + gamma * next_v - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv, adv + values


def segments(mask: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous runs of 1 in a loss mask as (start, end): the turns of a trajectory-wise sample."""
    out: list[tuple[int, int]] = []
    start = None
    for i, m in enumerate(mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    if start is not None:
        out.append((start, len(mask)))
    return out


def spread(value: float, mask: Sequence[int]) -> list[float]:
    """One sequence-level advantage on every model token of a sample (0 elsewhere)."""
    return [value if m else 0.0 for m in mask]


def _turn_rewards(s: Sample, num_turns: int) -> list[float]:
    if len(s.step_rewards) >= num_turns:
        return list(s.step_rewards[:num_turns])
    rewards = [0.0] * num_turns  # no per-turn rewards: the episode reward arrives at the last turn
    if num_turns:
        rewards[-1] = s.reward
    return rewards


def turn_return_advantages(samples: Sequence[Sample], gamma: float) -> list[list[float]]:
    """Per-turn discounted return-to-go minus the group's mean episode return (G_0), per model token.

    Turn-wise samples (`turn_index` set): turn t's tokens get G_t of its episode, where the episode's turn
    rewards are `step_rewards` when a sample carries the list, else each sample's own `reward`.
    Trajectory-wise samples: each loss-mask segment is a turn, rewarded by `step_rewards[k]`
    (or the episode reward at the last turn).
    """
    returns: list[list[float]] = []  # per sample: G of each of its turns
    episode_g0: dict[str, float] = {}
    by_episode: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        if s.turn_index is not None:
            by_episode[s.episode_id].append(i)
    step_g: dict[int, float] = {}
    for ep, idx in by_episode.items():
        idx.sort(key=lambda i: samples[i].turn_index or 0)
        first = samples[idx[0]]
        n = max(len(idx), (samples[idx[-1]].turn_index or 0) + 1)
        if len(first.step_rewards) >= n:
            rewards = list(first.step_rewards[:n])
        else:
            rewards = [0.0] * n
            for i in idx:
                rewards[samples[i].turn_index or 0] = samples[i].reward
        g = discounted_returns(rewards, gamma)
        episode_g0[ep] = g[0]
        for i in idx:
            step_g[i] = g[samples[i].turn_index or 0]
    for i, s in enumerate(samples):
        if i in step_g:
            returns.append([step_g[i]])
        else:
            g = discounted_returns(_turn_rewards(s, len(segments(s.loss_mask))), gamma)
            episode_g0[s.episode_id] = g[0] if g else 0.0
            returns.append(g)
    group_g0: dict[str, list[float]] = defaultdict(list)
    for ep, g0 in episode_g0.items():
        gid = next(s.group_id for s in samples if s.episode_id == ep)
        group_g0[gid].append(g0)
    baseline = {gid: sum(v) / len(v) for gid, v in group_g0.items()}
    out: list[list[float]] = []
    for i, s in enumerate(samples):
        b = baseline[s.group_id]
        if i in step_g:
            out.append(spread(step_g[i] - b, s.loss_mask))
            continue
        adv = [0.0] * len(s.token_ids)
        for (a, e), g in zip(segments(s.loss_mask), returns[i], strict=False):
            adv[a:e] = [g - b] * (e - a)
        out.append(adv)
    return out


def sequence_advantages(
    kind: str, rewards: Sequence[float], group_ids: Sequence[str], episode_ids: Sequence[str] | None = None
) -> list[float]:
    """Dispatch for the sequence-level estimators by config name.

    With `episode_ids`, every episode counts once however many samples (turns) it has: turn-wise samples of
    long episodes would otherwise dominate the group mean and std. The episode's advantage then applies to each
    of its samples (the form that learned Sokoban on CPU).
    """
    if episode_ids is not None:
        first: dict[str, int] = {}
        for i, episode in enumerate(episode_ids):
            first.setdefault(episode, i)
        rows = list(first.values())
        per_episode = sequence_advantages(kind, [rewards[i] for i in rows], [group_ids[i] for i in rows])
        by_episode = dict(zip(first, per_episode, strict=True))
        return [by_episode[e] for e in episode_ids]
    if kind == "grpo":
        return grpo(rewards, group_ids, use_std=True)
    if kind == "grpo_no_std":
        return grpo(rewards, group_ids, use_std=False)
    if kind == "rloo":
        return rloo(rewards, group_ids)
    if kind == "reinforce_pp":
        return reinforce_pp(rewards)
    raise ValueError(f"{kind!r} is not a sequence-level advantage estimator")


def gae_advantages(
    samples: Sequence[Sample],
    values: Sequence[Sequence[float]],
    gamma: float,
    lam: float,
    token_rewards: Sequence[Sequence[float]] | None = None,
) -> tuple[list[list[float]], list[list[float]]]:
    """GAE per sample over its model tokens only (env/tool tokens are not actions).

    The episode reward lands on the last model token, plus `token_rewards` (e.g. a per-token KL penalty) when
    given. Returns (advantages, value targets), both aligned with token_ids.
    """
    advs, rets = [], []
    for k, s in enumerate(samples):
        pos = [i for i, m in enumerate(s.loss_mask) if m]
        adv = [0.0] * len(s.token_ids)
        ret = [0.0] * len(s.token_ids)
        if pos:
            r = torch.zeros(len(pos), dtype=torch.float64)
            if token_rewards is not None:
                r += torch.tensor([token_rewards[k][i] for i in pos], dtype=torch.float64)
            r[-1] += s.reward
            v = torch.tensor([values[k][i] for i in pos], dtype=torch.float64)
            a, g = gae(r, v, gamma, lam)
            for j, i in enumerate(pos):
                adv[i], ret[i] = float(a[j]), float(g[j])
        advs.append(adv)
        rets.append(ret)
    return advs, rets
