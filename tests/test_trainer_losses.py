"""Advantages, losses, batching and lr schedule against hand-computed values (no Ray, no process group)."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from agentrl.trainer import advantages as A
from agentrl.trainer import losses as L
from agentrl.trainer.batching import collate, micro_batches, scatter_back, shard_indices
from agentrl.trainer.optim import lr_factor
from agentrl.types import Sample
from tests.hf_models import load_causal_lm
from tests.servers import free_port


def _sample(reward: float, group: str, ep: str, mask: list[int], turn: int | None = None, **kw) -> Sample:
    n = len(mask)
    return Sample(list(range(n)), mask, [0.0] * n, [0] * n, reward, group, ep, turn_index=turn, **kw)


# ---- advantages ------------------------------------------------------------------------------------------


def test_grpo_and_no_std() -> None:
    r, g = [1.0, 0.0, 0.0, 1.0, 5.0], ["a", "a", "a", "a", "b"]
    assert A.grpo(r, g) == pytest.approx([1, -1, -1, 1, 0], abs=1e-5)
    assert A.grpo(r, g, use_std=False) == pytest.approx([0.5, -0.5, -0.5, 0.5, 0.0])


def test_rloo_and_reinforce_pp() -> None:
    assert A.rloo([1.0, 0.0, 0.0, 1.0], ["a"] * 4) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert A.rloo([3.0], ["solo"]) == [0.0]
    s = math.sqrt(2 / 3)
    assert A.reinforce_pp([1.0, 2.0, 3.0]) == pytest.approx([-1 / s, 0.0, 1 / s], abs=1e-5)


def test_equal_rewards_give_exactly_zero_advantages() -> None:
    """-1.4 is not exact in binary: three copies' mean is off by an ulp, which dividing by the tiny std turned into
    ~2e-10. Exact zeros are what lets the trainer skip such a group's samples."""
    r, g = [-1.4] * 3 + [0.3, 0.3], ["a"] * 3 + ["b"] * 2
    assert A.grpo(r, g) == [0.0] * 5 and A.grpo(r, g, use_std=False) == [0.0] * 5
    assert A.rloo(r, g) == [0.0] * 5 and A.reinforce_pp([-1.4] * 3) == [0.0] * 3


def test_discounted_returns_and_gae() -> None:
    assert A.discounted_returns([0.0, 0.0, 1.0], 0.5) == [0.25, 0.5, 1.0]
    adv, ret = A.gae(torch.tensor([0.0, 1.0]), torch.tensor([0.5, 0.5]), gamma=1.0, lam=1.0)
    assert adv.tolist() == pytest.approx([0.5, 0.5]) and ret.tolist() == pytest.approx([1.0, 1.0])
    adv, _ = A.gae(torch.tensor([0.0, 1.0]), torch.tensor([0.5, 0.5]), gamma=1.0, lam=0.0)
    assert adv.tolist() == pytest.approx([0.0, 0.5])


def test_gae_with_gamma_and_lambda_below_one_against_a_hand_computed_case() -> None:
    """gamma 0.9, lambda 0.8 (1 hid a dropped gamma: `last = delta + lam * last` passed the cases above).
    deltas: 1 - 0.3 = 0.7; 0.9 * 0.3 - 0.4 = -0.13; 0.9 * 0.4 - 0.5 = -0.14.
    A2 = 0.7; A1 = -0.13 + 0.72 * 0.7 = 0.374; A0 = -0.14 + 0.72 * 0.374 = 0.12928."""
    adv, ret = A.gae(torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.5, 0.4, 0.3]), gamma=0.9, lam=0.8)
    assert adv.tolist() == pytest.approx([0.12928, 0.374, 0.7])
    assert ret.tolist() == pytest.approx([0.62928, 0.774, 1.0])


def test_the_value_clip_keeps_the_larger_error() -> None:
    """0.5 * max((v - R)^2, (v_clip - R)^2), v_clip = v_old + clamp(v - v_old, +-0.2): the clip can only add loss."""
    one, unit = torch.ones(1), 1.0
    # The clipped value is further from the return: (1.2 - 1.9)^2 = 0.49 counts, not the 0 of the new value.
    assert L.value_loss(1.9 * one, 1.0 * one, 1.9 * one, one, unit).item() == pytest.approx(0.245)
    # The new value is further: (1 - 0)^2 = 1 counts, not (0.2 - 0)^2.
    assert L.value_loss(1.0 * one, 0.0 * one, 0.0 * one, one, unit).item() == pytest.approx(0.5)
    assert L.value_loss(1.9 * one, 1.0 * one, 1.9 * one, one, unit, clip=None).item() == 0.0


def test_gae_runs_over_model_tokens_only() -> None:
    s = _sample(1.0, "g", "e", [0, 1, 0, 0, 1])
    adv, ret = A.gae_advantages([s], [[9.0, 0.5, 9.0, 9.0, 0.5]], gamma=1.0, lam=1.0)
    assert adv[0] == pytest.approx([0, 0.5, 0, 0, 0.5]) and ret[0] == pytest.approx([0, 1, 0, 0, 1])


def test_turn_return_step_wise_samples() -> None:
    # episode e1: turn rewards 0, 1; e2: one turn, reward 0. gamma 0.5 -> G(e1) = [0.5, 1], G(e2) = [0].
    samples = [
        _sample(0.0, "g", "e1", [0, 1], 0),
        _sample(1.0, "g", "e1", [0, 1], 1),
        _sample(0.0, "g", "e2", [0, 1], 0),
    ]
    out = A.turn_return_advantages(samples, gamma=0.5)
    b = (0.5 + 0.0) / 2  # baseline: group mean of the episodes' G_0
    assert out == [[0, 0.5 - b], [0, 1 - b], [0, -b]]


def test_turn_return_trajectory_segments() -> None:
    s1 = _sample(0.0, "g", "e1", [0, 1, 1, 0, 1], step_rewards=[0.0, 1.0])
    s2 = _sample(0.0, "g", "e2", [0, 1, 0, 0, 0], step_rewards=[0.0])
    out = A.turn_return_advantages([s1, s2], gamma=1.0)
    assert out[0] == [0, 0.5, 0.5, 0, 0.5] and out[1] == [0, -0.5, 0, 0, 0]


# ---- losses ------------------------------------------------------------------------------------------


def _t(*x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)[None]


def test_ppo_clip_hand_values_and_clip_fraction() -> None:
    logp = torch.log(_t(1.5, 0.5, 1.1))  # old log-probs 0 -> ratios 1.5, 0.5, 1.1
    adv, w = _t(1.0, -1.0, 1.0), _t(1, 1, 1)
    loss, st = L.ppo_clip_loss(logp, torch.zeros_like(logp), adv, w, denom=3)
    assert float(loss) == pytest.approx((-1.2 + 0.8 - 1.1) / 3)
    assert float(st["clipped"]) / float(st["tokens"]) == pytest.approx(2 / 3)
    higher, _ = L.ppo_clip_loss(logp, torch.zeros_like(logp), adv, w, denom=3, clip_high=0.28)
    assert float(higher) == pytest.approx((-1.28 + 0.8 - 1.1) / 3)


def test_dual_clip_caps_negative_advantage_loss() -> None:
    logp = torch.log(_t(5.0))
    loss, st = L.ppo_clip_loss(logp, torch.zeros_like(logp), _t(-1.0), _t(1), 1, dual_clip=3.0)
    assert float(loss) == pytest.approx(3.0) and float(st["dual_clipped"]) == 1.0
    plain, _ = L.ppo_clip_loss(logp, torch.zeros_like(logp), _t(-1.0), _t(1), 1)
    assert float(plain) == pytest.approx(5.0)


def test_decoupled_equals_ppo_clip_on_policy() -> None:
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 7, generator=g) * 0.3 - 2
    old = logp + torch.randn(3, 7, generator=g) * 0.2
    adv = torch.randn(3, 7, generator=g)
    mask = (torch.rand(3, 7, generator=g) > 0.3).float()
    seq = torch.arange(3)[:, None].expand(3, 7)
    for level in ("token", "sequence"):
        d, _ = L.decoupled_ppo_loss(logp, old, old, adv, mask, mask.sum(), seq, dual_clip=3.0, is_level=level)
        p, _ = L.ppo_clip_loss(logp, old, adv, mask, mask.sum(), dual_clip=3.0)
        assert float(d) == pytest.approx(float(p), abs=1e-6)


def test_decoupled_importance_weights_truncated() -> None:
    prox, behav = torch.log(_t(0.5, 0.9)), torch.log(_t(0.1, 0.9))  # token weights 5 -> 2 (truncated), 1
    mask, seq = _t(1, 1), torch.zeros(1, 2, dtype=torch.long)
    assert L.is_weights(prox, behav, mask, seq, 2.0, "token")[0].tolist() == pytest.approx([2.0, 1.0])
    prox, behav = torch.log(_t(0.5, 0.5)), torch.log(_t(0.4, 0.5))  # sequence: 1.25 * 1 on both tokens
    assert L.is_weights(prox, behav, mask, seq, 2.0, "sequence")[0].tolist() == pytest.approx([1.25, 1.25])
    logp = prox.clone()  # ratio 1 -> per-token loss -A * is_weight
    loss, st = L.decoupled_ppo_loss(logp, prox, behav, _t(1.0, 1.0), mask, 2, seq, is_level="sequence")
    assert float(loss) == pytest.approx(-1.25) and float(st["is_truncated"]) == 0.0


def test_masked_tokens_contribute_nothing() -> None:
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    mask = _t(1, 0, 1)
    a, _ = L.ppo_clip_loss(logp, _t(-1.2, -2.0, -2.5), _t(1.0, 1.0, -1.0), mask, 2)
    b, _ = L.ppo_clip_loss(logp, _t(-1.2, 7.0, -2.5), _t(1.0, -50.0, -1.0), mask, 2)
    assert float(a.detach()) == float(b.detach())
    a.backward()
    assert logp.grad[0, 1] == 0.0
    assert float(L.sft_loss(torch.tensor([[-1.0, -99.0]]), _t(1, 0), 1)) == 1.0


def test_kl_estimators() -> None:
    logp, ref = torch.log(torch.tensor(0.5)), torch.log(torch.tensor(0.25))
    assert float(L.kl_penalty(logp, ref, "k1")) == pytest.approx(math.log(2))
    assert float(L.kl_penalty(logp, ref, "k3")) == pytest.approx(0.5 + math.log(2) - 1)
    assert float(L.kl_penalty(ref, ref, "k3")) == 0.0


def test_aggregations() -> None:
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    seq = torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1]])
    v = torch.tensor([[1.0, 2.0, 3.0, 100.0], [10.0, 100.0, 100.0, 100.0]])
    assert float(L.aggregate(v, L.token_weights(mask, seq, "token_mean"), 4)) == pytest.approx(16 / 4)
    assert float(L.aggregate(v, L.token_weights(mask, seq, "seq_mean_token_sum"), 2)) == pytest.approx(8.0)
    assert float(L.aggregate(v, L.token_weights(mask, seq, "seq_mean_token_mean"), 2)) == pytest.approx(6.0)
    ent = L.token_logprobs(torch.zeros(1, 4), None, with_entropy=True)[1]
    assert float(ent) == pytest.approx(math.log(4))


# ---- batching and schedule -----------------------------------------------------------------------------


def test_shard_and_micro_batches() -> None:
    lengths = [100, 10, 60, 50, 40, 30]
    shards = shard_indices(lengths, 2)
    assert sorted(i for s in shards for i in s) == list(range(6))
    loads = [sum(lengths[i] for i in s) for s in shards]
    assert abs(loads[0] - loads[1]) <= 10
    mbs = micro_batches(range(6), lengths, budget=120, layout="packed")
    assert all(sum(lengths[i] for i in mb) <= 120 or len(mb) == 1 for mb in mbs)
    pad = micro_batches(range(6), lengths, budget=120, layout="pad")
    assert all(len(mb) * max(lengths[i] for i in mb) <= 120 or len(mb) == 1 for mb in pad)
    # Equal lengths, prompts A B A B A B: each micro-batch of 3 holds one prompt only (run once by the trainer).
    same = micro_batches(range(6), [10] * 6, budget=30, layout="pad", prompts=[7, 9] * 3)
    assert same == [[0, 2, 4], [1, 3, 5]]
    # A trainer that runs the tokens prompts share once: a prompt costs what it adds to the micro-batch's trie
    # (its 10 tokens, or 4 after the 6 it shares with the previous prompt), each row its 2 tokens after it.
    a, b = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10), (1, 2, 3, 4, 5, 6, 17, 18, 19, 20)
    shared = micro_batches(range(6), [12] * 6, budget=24, layout="pad", prompts=[0, 1] * 3, prompt_tokens=[a, b] * 3)
    assert shared == [[0, 2, 4, 1, 3], [5]]  # 12 + 2 + 2, + (12 - 6) + 2 = 24; then a new micro-batch


def test_collate_layouts() -> None:
    toks = [[5, 6, 7], [8, 9]]
    fields = {"loss_mask": [[1, 1, 1], [1, 1]], "adv": [[1.0, 2.0, 3.0], [4.0, 5.0]]}
    pad = collate(toks, fields, "pad", pad_id=0)
    assert pad["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert pad["loss_mask"].tolist() == [
        [0, 1, 1],
        [0, 1, 0],
    ]  # first token of each sequence: nothing predicts it
    packed = collate(toks, fields, "packed", pad_id=0)
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert packed["loss_mask"].tolist() == [[0, 1, 1, 0, 1]]
    assert packed["attention_mask"][0, 0, 3].tolist() == [False, False, False, True, False]
    assert scatter_back(packed["adv"], packed) == [[1.0, 2.0, 3.0], [4.0, 5.0]]


def _collate_row_by_row(toks, fields, layout, pad_id):
    """The reference: every sequence and field written on its own (what collate computes in one go)."""
    n, lengths = len(toks), [len(t) for t in toks]
    shape = (n, max(lengths)) if layout == "pad" else (1, sum(lengths))
    ids, pos, seq = torch.full(shape, pad_id), torch.zeros(shape, dtype=torch.long), torch.full(shape, -1)
    out = {k: torch.zeros(shape) for k in fields}
    for k, t in enumerate(toks):
        r, a = (k, 0) if layout == "pad" else (0, sum(lengths[:k]))
        ids[r, a : a + len(t)], pos[r, a : a + len(t)], seq[r, a : a + len(t)] = (
            torch.tensor(t),
            torch.arange(len(t)),
            k,
        )
        for name, values in fields.items():
            out[name][r, a : a + len(t)] = torch.tensor(values[k], dtype=torch.float32)
            if name == "loss_mask":
                out[name][r, a] = 0.0
    return {"input_ids": ids, "position_ids": pos, "seq_ids": seq, **out}


@pytest.mark.parametrize("layout", ["pad", "packed"])
def test_collate_puts_every_token_and_field_where_a_row_by_row_write_would(layout) -> None:
    rng = random.Random(3)
    toks = [[rng.randint(1, 99) for _ in range(rng.randint(1, 30))] for _ in range(40)]
    fields = {
        "loss_mask": [[float(rng.random() < 0.5) for _ in t] for t in toks],
        "adv": [[rng.uniform(-1, 1) for _ in t] for t in toks],
    }
    got, want = collate(toks, fields, layout, pad_id=0), _collate_row_by_row(toks, fields, layout, 0)
    for key, expected in want.items():
        assert torch.equal(got[key], expected), key
    assert scatter_back(got["adv"], got) == [
        [float(torch.tensor(v, dtype=torch.float32)) for v in a] for a in fields["adv"]
    ]
    with pytest.raises(ValueError, match="field 'adv' does not have one value per token"):
        collate(toks[:2], {"adv": [fields["adv"][1], fields["adv"][0]]}, layout, pad_id=0)


def test_lr_schedule() -> None:
    assert [lr_factor(s, 2, 10, "constant") for s in range(3)] == [0.5, 1.0, 1.0]
    assert lr_factor(6, 2, 10, "linear") == pytest.approx(0.5)
    assert lr_factor(6, 2, 10, "cosine") == pytest.approx(0.5)
    assert lr_factor(10, 2, 10, "cosine") == pytest.approx(0.0)


def test_export_cli_rejects_non_checkpoint(tmp_path, capsys) -> None:
    from agentrl.cli import main

    assert main(["export", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "not an agentrl trainer checkpoint" in capsys.readouterr().err


def test_step_wise_samples_count_each_episode_once_in_the_group():
    from agentrl.trainer.advantages import sequence_advantages

    # episode a: 1 turn, return 1; episode b: 3 turns, return 0 -> +1 / -1 for every turn, not skewed by turn count
    rewards, groups, episodes = [1.0, 0.0, 0.0, 0.0], ["g"] * 4, ["a", "b", "b", "b"]
    adv = sequence_advantages("grpo", rewards, groups, episodes)
    assert adv[0] == pytest.approx(1.0, abs=1e-4) and all(x == pytest.approx(-1.0, abs=1e-4) for x in adv[1:])
    skewed = sequence_advantages("grpo", rewards, groups)
    assert skewed[0] == pytest.approx(3**0.5, abs=1e-4)


@pytest.mark.parametrize("layout", ["pad", "packed"])
def test_logprobs_at_loss_positions_equal_the_full_pass(tiny_model_path, layout) -> None:
    """The LM head runs only where the loss mask is set; those log-probs (and their gradients) must equal the
    ones of the full pass; columns no row trains on hold 0."""
    from agentrl.trainer.model import forward_logprobs

    torch.manual_seed(0)
    model = load_causal_lm(tiny_model_path, torch.float32, torch.device("cpu"))
    lengths = [20, 14, 9]
    toks = [[5 + (7 * i + j) % 200 for j in range(n)] for i, n in enumerate(lengths)]
    masks = [[0] * (n - 4) + [1] * 4 for n in lengths]
    full = collate(toks, {}, layout, 0)
    part = collate(toks, {"loss_mask": masks}, layout, 0)
    lp_full, _ = forward_logprobs(model, full)
    lp_part, ent = forward_logprobs(model, part, with_entropy=True)
    mask = part["loss_mask"] > 0
    assert torch.allclose(lp_part[mask], lp_full[mask], atol=1e-5)
    unused = ~mask.any(dim=0)  # columns no row trains on were never computed
    assert (lp_part[:, unused] == 0).all() and unused.sum() > 0 and (ent[mask] > 0).all()
    (lp_part * part["loss_mask"]).sum().backward()
    g_part = model.model.embed_tokens.weight.grad.clone()
    model.zero_grad()
    (lp_full * part["loss_mask"]).sum().backward()
    assert torch.allclose(g_part, model.model.embed_tokens.weight.grad, atol=1e-5)


def _prompt_rows(repeats: bool) -> tuple[list[list[int]], list[list[int]]]:
    """Rows that all start with the same 24 tokens (a system prompt); with `repeats`, several rows also carry the
    same whole prompt (contexts of two lengths) with answers of different lengths, one of them trained on two
    separate spans (a multi-turn sample)."""
    prefix = [9 + j % 50 for j in range(24)]
    if not repeats:
        toks = [prefix + [60 + (5 * i + j) % 150 for j in range(n)] for i, n in enumerate([12, 7, 10, 7])]
        return toks, [[0] * (len(t) - 3) + [1] * 3 for t in toks]
    a, b, c = [prefix + [70 + (3 * k + j) % 90 for j in range(n)] for k, n in enumerate([14, 6, 9])]
    answers = [[200, 201, 2], [202, 2], [203, 204, 205, 206, 2], [200, 201, 2], [207, 2]]
    contexts = [a, a, a, b, b]
    toks = [ctx + ans for ctx, ans in zip(contexts, answers, strict=True)] + [[*c, 210, 211, 2, 212, 213, 214, 2]]
    masks = [[0] * len(ctx) + [1] * len(ans) for ctx, ans in zip(contexts, answers, strict=True)]
    masks.append([0] * len(c) + [1, 1, 1, 0, 0, 1, 1])
    return toks, masks


@pytest.mark.parametrize("tree", [True, False], ids=["tree-sdpa", "row-flash-layout"])
@pytest.mark.parametrize(("fsdp", "repeats"), [(False, False), (True, False), (False, True), (True, True)])
def test_shared_prompts_run_once_and_change_nothing(tiny_model_path, fsdp, repeats, tree, monkeypatch) -> None:
    """The system prompt every row starts with runs once, and so does each prompt several rows repeat; their KV
    cache feeds the rows. Log-probs, entropies and every parameter's gradient must equal the plain pass (also
    under FSDP2), and every position outside the loss mask holds 0. Both ways of running the rows' answers: side
    by side under a tree mask (SDPA), and one row each on a copy of the context's cache (the flash-attention
    layout, run here through SDPA: flash kernels need CUDA or an NPU)."""
    import os

    import torch.distributed as dist

    from agentrl.trainer import model as M
    from agentrl.trainer import prompt_sharing as PS

    torch.manual_seed(0)
    model = load_causal_lm(tiny_model_path, torch.float32, torch.device("cpu"))
    if fsdp:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=0, world_size=1)
        model = M.apply_fsdp2(model)
    toks, masks = _prompt_rows(repeats)
    batch = collate(toks, {"loss_mask": masks}, "pad", 0)
    assert PS._takes_custom_masks(model)  # the tiny model runs SDPA: the tree layout unless told otherwise
    if not tree:
        monkeypatch.setattr(PS, "_takes_custom_masks", lambda _model: False)
    plan = PS.plan_sharing(batch)
    assert plan is not None and plan.prefix == 24
    assert plan.contexts.shape[0] == (3 if repeats else 1)  # distinct prompts

    lp_plain, ent_plain, g_plain = _logprobs_and_grads(model, batch, share=False)
    lp_shared, ent_shared, g_shared = _logprobs_and_grads(model, batch, share=True)
    assert bool((lp_plain[batch["loss_mask"] > 0] < 0).all())
    outside = batch["loss_mask"] == 0
    assert bool((lp_shared[outside] == 0).all()) and bool((ent_shared[outside] == 0).all())
    assert torch.allclose(lp_plain, lp_shared, atol=1e-5)
    assert torch.allclose(ent_plain, ent_shared, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(g_plain, g_shared, strict=True))
    if fsdp:
        dist.destroy_process_group()


def test_tree_layout_runs_shared_context_tokens_once_and_each_row_sees_exactly_its_context() -> None:
    """Contexts become tries in tree rows: a token several contexts share runs once, every row's suffix sits in
    its tree row's last columns without overlap, and the trie tokens a row's suffix may see (by the layout's
    intervals) spell exactly its own context at the right positions; a context with very many answers is split
    over tree rows (attention grows with the square of a row)."""
    from agentrl.trainer.prompt_sharing import _tree_layout

    def check(tails: list[tuple[int, ...]], inverse: list[int], lengths: list[int], prefix: int):
        lay = _tree_layout(tails, inverse, lengths, prefix)
        used: dict[int, list[tuple[int, int]]] = {}
        for r, (u, n) in enumerate(zip(inverse, lengths, strict=True)):
            t, end = lay.tree_of[r], lay.context_end[r]
            seen = [c for c in range(lay.width) if lay.lo[t][c] >= 0 and lay.lo[t][c] <= end <= lay.hi[t][c]]
            assert [lay.tokens[t][c] for c in seen] == list(tails[u])
            assert [lay.positions[t][c] for c in seen] == list(range(prefix, prefix + len(tails[u])))
            assert lay.width - lay.span <= lay.start[r] and lay.start[r] + n <= lay.width
            assert all(lay.lo[t][c] < 0 for c in range(lay.start[r], lay.start[r] + n))  # no trie token there
            used.setdefault(t, []).append((lay.start[r], lay.start[r] + n))
        for spans in used.values():
            spans.sort()
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # no two suffixes overlap
        return lay

    tails = [(5, 6, 7, 8), (5, 6, 9), (5, 6, 7, 8, 10), (11,), ()]
    lay = check(tails, [0, 0, 1, 2, 3, 4, 1], [3, 2, 5, 3, 2, 7, 1], prefix=24)
    trie = sum(1 for row in lay.lo for c in row if c >= 0)
    assert lay.trees == 1 and trie == 7  # 5 6 7 8 10, 9, 11: 13 context tokens run as 7
    crowded = check([(1, 2, 3, 4)], [0] * 64, [5] * 64, prefix=0)
    assert 1 < crowded.trees < 64
    rng = random.Random(0)  # turn-wise: 40 grids of one level (6 rows of 7 tokens), a few lower rows redrawn
    level = [[rng.randint(3, 9) for _ in range(7)] for _ in range(6)]

    def grid() -> tuple[int, ...]:
        redrawn = rng.randint(3, 5)
        rows = level[:redrawn] + [[rng.randint(3, 9) for _ in range(7)] for _ in range(6 - redrawn)]
        visit = (99, rng.randint(2, 4)) if rng.random() < 0.3 else ()  # a "(visit k)" line on some
        return tuple(tok for row in rows for tok in row) + visit

    tails = sorted({grid() for _ in range(40)})
    inverse = [u for u in range(len(tails)) for _ in range(rng.randint(1, 6))]
    lay = check(tails, inverse, [rng.randint(3, 8) for _ in inverse], prefix=65)
    assert sum(1 for row in lay.lo for c in row if c >= 0) < 0.5 * sum(len(t) for t in tails)


def test_repeated_prompts_without_a_common_prefix_share_exactly(tiny_model_path) -> None:
    """Rows whose prompts repeat but start differently (no prefix cache): each distinct prompt runs once under
    the tree mask, and log-probs and gradients still equal the plain pass."""
    from agentrl.trainer import prompt_sharing as PS

    torch.manual_seed(0)
    model = load_causal_lm(tiny_model_path, torch.float32, torch.device("cpu"))
    a, b, c = [9, 10, 11, *range(70, 100)], [9, 10, 11, *range(80, 105)], [5, *range(90, 118)]
    contexts = [a, a, a, b, b, c]
    answers = [[200, 201, 2], [202, 2], [203, 204, 205, 2], [200, 2], [207, 208, 2], [1, 2]]
    toks = [x + y for x, y in zip(contexts, answers, strict=True)]
    masks = [[0] * len(x) + [1] * len(y) for x, y in zip(contexts, answers, strict=True)]
    batch = collate(toks, {"loss_mask": masks}, "pad", 0)
    plan = PS.plan_sharing(batch)
    assert plan is not None and plan.prefix == 0 and plan.contexts.shape[0] == 3

    (lp_plain, _, g_plain), (lp_shared, _, g_shared) = (
        _logprobs_and_grads(model, batch, False),
        _logprobs_and_grads(model, batch, True),
    )
    assert torch.allclose(lp_plain, lp_shared, atol=1e-5)
    assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(g_plain, g_shared, strict=True))


def test_contexts_sharing_a_path_or_nested_in_another_share_exactly(tiny_model_path) -> None:
    """The trie case: contexts that share their first tokens after the common prefix, one context that is the
    start of another (its end is an inner node of the trie), and repeats. Log-probs and gradients equal the plain
    pass, and the shared tokens run once."""
    from agentrl.trainer import prompt_sharing as PS

    torch.manual_seed(0)
    model = load_causal_lm(tiny_model_path, torch.float32, torch.device("cpu"))
    prefix, grid = [3 + (7 * j) % 50 for j in range(24)], [60 + (5 * j) % 40 for j in range(12)]
    a = prefix + grid  # a state
    nested = [*a, 120, 121, 122]  # the same state with a "(visit k)" line: `a` is its start
    sibling = [*prefix, *grid[:6], 130, 131, 132, 133, 134, 135]  # the lower rows differ
    other = [*prefix, *range(140, 152)]  # another level
    contexts = [a, nested, a, sibling, nested, sibling, other]
    answers = [[200, 201, 2], [202, 2], [203, 204, 205, 2], [200, 2], [207, 208, 2], [1, 2], [209, 2]]
    toks = [x + y for x, y in zip(contexts, answers, strict=True)]
    masks = [[0] * len(x) + [1] * len(y) for x, y in zip(contexts, answers, strict=True)]
    batch = collate(toks, {"loss_mask": masks}, "pad", 0)
    plan = PS.plan_sharing(batch)
    assert plan is not None and plan.prefix == 24 and plan.contexts.shape[0] == 4
    # each row's context stops before its last prompt token: tails of 11 (a), 14 (nested), 11 and 11 tokens
    ctx_len = (plan.context_mask.sum(dim=1) - 24).tolist()
    tails = [tuple(row[24 : 24 + k]) for row, k in zip(plan.contexts.tolist(), ctx_len, strict=True)]
    suffix = (batch["attention_mask"].sum(dim=1) - plan.cuts).tolist()
    lay = PS._tree_layout(tails, plan.inverse.tolist(), suffix, 24)
    assert sum(1 for row in lay.lo for c in row if c >= 0) == 14 + 5 + 11  # not 11 + 14 + 11 + 11

    (lp_plain, _, g_plain), (lp_shared, _, g_shared) = (
        _logprobs_and_grads(model, batch, False),
        _logprobs_and_grads(model, batch, True),
    )
    assert bool((lp_plain[batch["loss_mask"] > 0] < 0).all())
    assert torch.allclose(lp_plain, lp_shared, atol=1e-5)
    assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(g_plain, g_shared, strict=True))


def _logprobs_and_grads(model, batch: dict, share: bool) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Log-probs and entropies of `batch`, and every parameter's (full) gradient of the log-probs' sum, with
    prompt sharing on (the plan `sharing_plan` finds) or off (the plain pass)."""
    from agentrl.trainer import model as M

    lp, ent = M.forward_logprobs(model, batch, with_entropy=True, plan="auto" if share else None)
    (lp * batch["loss_mask"]).sum().backward()
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return lp.detach(), ent.detach(), grads
