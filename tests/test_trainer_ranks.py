"""TrainerGroup on Ray with FSDP2 over gloo: 1 vs 2 ranks, checkpoint round trip, weight export, SFT.

One Ray session for the module; each group start costs a few seconds on our 2 cores.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from agentrl.config.schema import Config  # noqa: E402
from agentrl.models.tiny import resolve_model_path  # noqa: E402
from agentrl.trainer import TrainerGroup  # noqa: E402
from agentrl.types import Sample  # noqa: E402


def _cfg(num_ranks: int) -> Config:
    cfg = Config()
    cfg.trainer.num_ranks = num_ranks
    cfg.trainer.micro_batch_tokens = 160  # several micro-batches per rank: exercises accumulation
    cfg.trainer.optim.lr = 1e-3
    # Adam's first step is lr * g / (|g| + eps): with eps 1e-8 a near-zero gradient becomes a full +-lr step
    # whose sign is fp32 rounding noise, so 1 and 2 ranks could differ by ~lr on a few weights. A larger eps
    # keeps the update linear in small gradients and the comparison meaningful.
    cfg.trainer.optim.eps = 1e-4
    cfg.trainer.algorithm.clip_low = 0.2
    cfg.trainer.algorithm.clip_high = 0.28
    return cfg


SYSTEM = [7 + (3 * j) % 90 for j in range(18)]  # a shared system prompt: exercises the shared-prefix pass


def _samples(n: int = 12, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length, prompt = rng.randint(16, 56), rng.randint(4, 10)
        toks = SYSTEM + [rng.randint(3, 300) for _ in range(length)]
        mask = [0] * (len(SYSTEM) + prompt) + [1] * (length - prompt)
        length = len(toks)
        out.append(Sample(toks, mask, [0.0] * length, [0] * length, float(i % 3), f"g{i // 4}", f"e{i}"))
    return out


def _with_behaviour(samples: list[Sample], logprobs: list[list[float]], seed: int = 1) -> list[Sample]:
    """Behaviour log-probs = the trainer's plus noise: a slightly stale policy, so IS weights matter."""
    rng = random.Random(seed)
    for s, lp in zip(samples, logprobs, strict=True):
        s.logprobs = [(x + rng.uniform(-0.1, 0.1)) if m else 0.0 for x, m in zip(lp, s.loss_mask, strict=True)]
    return samples


def _load(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))


@pytest.fixture(scope="module")
def shm(tmp_path_factory):
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path_factory.mktemp("shm")
    d = root / f"agentrl-test-trainer-{random.randrange(1 << 30)}"
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def one_rank_run(ray_session, shm):
    """One step on 1 rank: samples, log-probs before, metrics, exported weights dir, log-probs after."""
    group = TrainerGroup(_cfg(1))
    try:
        samples = _samples()
        before = group.compute_logprobs(samples)
        samples = _with_behaviour(samples, before)
        metrics = group.train_step(samples)
        out = group.export_weights(str(shm / "one"))
        after = group.compute_logprobs(samples)
        assert group.version == 1
    finally:
        group.shutdown()
    return samples, before, metrics, out, after


def test_one_vs_two_ranks_same_loss_and_weights(one_rank_run, shm, tmp_path_factory) -> None:
    samples, before, m1, w1, _ = one_rank_run
    ckpt = tmp_path_factory.mktemp("ckpt") / "step1"
    group = TrainerGroup(_cfg(2))
    try:
        before2 = group.compute_logprobs(samples)
        for a, b in zip(before, before2, strict=True):
            assert a == pytest.approx(b, abs=1e-5)
        m2 = group.train_step(samples)
        w2 = group.export_weights(str(shm / "two"))
        group.save_checkpoint(str(ckpt))
        next_batch = _with_behaviour(_samples(seed=5), group.compute_logprobs(_samples(seed=5)))
        m_next = group.train_step(next_batch)
    finally:
        group.shutdown()
    for key in ("train/loss", "train/kl", "train/entropy", "train/clip_frac", "train/grad_norm", "train/lr"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), key
    s1, s2 = _load(w1), _load(w2)
    assert s1.keys() == s2.keys()
    for k in s1:
        torch.testing.assert_close(s1[k], s2[k], rtol=1e-5, atol=1e-6)
    init = _load_initial()
    assert any(not torch.equal(init[k], s1[k]) for k in s1), "the step changed no weight"

    # Save, stop the actors, load in fresh ones: the next step's loss is identical.
    group = TrainerGroup(_cfg(2))
    try:
        assert group.load_checkpoint(str(ckpt)) == 1
        m_resumed = group.train_step(next_batch)
        assert group.version == 2
    finally:
        group.shutdown()
    for key in ("train/loss", "train/grad_norm", "train/lr", "train/clip_frac"):
        assert m_resumed[key] == pytest.approx(m_next[key], rel=1e-6, abs=1e-7), key
    assert "train/version" not in m_resumed  # metrics carry no state: the group tracks the version

    # `agentrl export CKPT OUT` gives a transformers model dir with the step-1 weights.
    out = tmp_path_factory.mktemp("hf") / "model"
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl", "export", str(ckpt), str(out)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    for k, v in model.state_dict().items():
        if k in s2:
            torch.testing.assert_close(v, s2[k], rtol=0, atol=0)


def _uneven_samples() -> list[Sample]:
    """One long sample (a micro-batch of one row: the plain pass) that fills one rank's shard, and eight short
    ones repeating one prompt (the shared passes: two model calls) on the other rank."""
    rng = random.Random(3)
    long = SYSTEM + [rng.randint(3, 300) for _ in range(300)]
    prompt = [rng.randint(3, 300) for _ in range(8)]
    out = [Sample(long, [0] * 30 + [1] * (len(long) - 30), [0.0] * len(long), [0] * len(long), 1.0, "g1", "e0")]
    for i in range(8):
        toks = SYSTEM + prompt + [rng.randint(3, 300) for _ in range(6)]
        mask = [0] * (len(SYSTEM) + len(prompt)) + [1] * 6
        out.append(Sample(toks, mask, [0.0] * len(toks), [0] * len(toks), float(i % 3), "g1", f"e{i + 1}"))
    return out


def test_ranks_whose_micro_batches_run_different_passes_stay_in_step(ray_session) -> None:
    """FSDP2's all-gathers pair up only if every rank makes the same model calls per micro-batch. Here one rank's
    micro-batch is a single row (one call) or padding, the other's shares a prompt (two calls): the ranks agree
    to run such a micro-batch plain. (Without that this hung.) Log-probs and the step equal one rank's."""
    results = []
    for ranks in (1, 2):
        group = TrainerGroup(_cfg(ranks))
        try:
            samples = _uneven_samples()
            samples = _with_behaviour(samples, group.compute_logprobs(samples))
            results.append((group.compute_logprobs(samples), group.train_step(samples)))
        finally:
            group.shutdown()
    (lp1, m1), (lp2, m2) = results
    for a, b in zip(lp1, lp2, strict=True):
        assert a == pytest.approx(b, abs=1e-5)
    for key in ("train/loss", "train/entropy", "train/grad_norm"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-6), key


def _load_initial() -> dict[str, torch.Tensor]:
    return _load(resolve_model_path("builtin:tiny"))


def test_exported_weights_load_into_hf_with_trainer_logprobs(one_rank_run) -> None:
    """The export dir is what an engine reloads: a fresh HF model on it reproduces the trainer's log-probs."""
    from transformers import AutoModelForCausalLM

    samples, _, _, out, after = one_rank_run
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for s, expected in zip(samples[:4], after[:4], strict=True):
        ids = torch.tensor([s.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        assert [0.0, *logp.tolist()] == pytest.approx(expected, abs=1e-5)


def _chat_samples(tokenizer, n: int) -> list[Sample]:
    """SFT demonstrations built by hand from the chat template: loss on the assistant reply only."""
    out = []
    for i in range(n):
        action = ["Up", "Down", "Left", "Right"][i % 4]
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Push the box. Hint: {action}"}],
            tokenize=True,
            add_generation_prompt=True,
            return_dict=False,
        )
        reply = tokenizer.encode(f"<answer>{action}</answer><|im_end|>", add_special_tokens=False)
        toks = list(prompt) + reply
        mask = [0] * len(prompt) + [1] * len(reply)
        out.append(Sample(toks, mask, [0.0] * len(toks), [0] * len(toks), 0.0, f"g{i}", f"e{i}"))
    return out


def test_sft_step_lowers_loss_on_demonstrations(ray_session) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny"))
    samples = _chat_samples(tokenizer, 16)
    cfg = _cfg(1)
    cfg.trainer.sft.lr = 3e-3
    cfg.trainer.optim.schedule, cfg.trainer.optim.warmup_steps = "linear", 4  # RL's schedule: not the warm start's
    group = TrainerGroup(cfg)
    try:
        steps = [group.sft_step(samples) for _ in range(8)]
        losses = [m["sft/loss"] for m in steps]
        assert [m["sft/lr"] for m in steps] == [3e-3] * 8
        assert group.version == 0  # a warm start: the policy version counts RL batches only
        lp = group.compute_logprobs(samples[:1])[0]
    finally:
        group.shutdown()
    assert losses[-1] < 0.7 * losses[0], losses
    mask = samples[0].loss_mask
    assert -sum(x for x, m in zip(lp, mask, strict=True) if m) / sum(mask) < losses[0]


def test_gae_critic_reference_kl_packed_layout(ray_session, tmp_path) -> None:
    """The other code paths on one rank: GAE critic, reference model with KL in the reward, packed micro-batches,
    sequence-level IS weights, dual-clip, two PPO epochs; and a checkpoint round trip with the critic."""
    cfg = _cfg(1)
    cfg.trainer.packing = "packed"
    alg = cfg.trainer.algorithm
    alg.advantage, alg.kl_coef, alg.kl_in_reward, alg.is_level = "gae", 0.05, True, "sequence"
    alg.dual_clip, alg.ppo_epochs, alg.loss_agg = 3.0, 2, "seq_mean_token_mean"
    group = TrainerGroup(cfg)
    try:
        samples = _samples(8)
        samples = _with_behaviour(samples, group.compute_logprobs(samples))
        m = group.train_step(samples)
        assert group.version == 1 and m["train/optimizer_steps"] == 2 and m["train/value_loss"] > 0
        assert all(v == v and abs(v) < 1e6 for v in m.values()), m
        group.save_checkpoint(str(tmp_path / "ck"))
        meta = json.loads((tmp_path / "ck" / "meta.json").read_text())
        assert (meta["version"], meta["optimizer_steps"]) == (1, 2)
        after = group.train_step(samples)
        assert group.load_checkpoint(str(tmp_path / "ck")) == 1
        again = group.train_step(samples)
    finally:
        group.shutdown()
    assert again["train/loss"] == pytest.approx(after["train/loss"], rel=1e-6, abs=1e-7)
    assert again["train/value_loss"] == pytest.approx(after["train/value_loss"], rel=1e-6, abs=1e-7)


def test_mini_batches_share_one_proximal_policy(ray_session) -> None:
    """k mini-batch optimizer steps per train_step clip against the policy from before the first of them: on
    on-policy data the later mini-batches see ratios != 1 and, at a large lr, clipping. (Recomputing the
    proximal policy per mini-batch would pin every ratio at exactly 1: no trust region.)"""
    cfg = _cfg(1)
    cfg.trainer.optim.lr = 3e-2
    cfg.trainer.algorithm.mini_batches = 4
    group = TrainerGroup(cfg)
    try:
        samples = _samples(16)
        lp = group.compute_logprobs(samples)
        for s, x in zip(samples, lp, strict=True):
            s.logprobs = x
        m = group.train_step(samples)
    finally:
        group.shutdown()
    assert group.version == 1 and m["train/optimizer_steps"] == 4
    assert abs(m["train/ratio_mean"] - 1.0) > 1e-3 and m["train/clip_frac"] > 0, m
    assert m["train/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)


def test_episode_mean_weighs_every_episode_once(ray_session) -> None:
    """Turn-wise samples: episode A has 3 turns (rewarded), B and C one each. With episode_mean every episode
    weighs 1, so at ratio 1 the GRPO advantages (which sum to 0 over episodes) cancel: pg_loss 0. token_mean
    would give A's turns 3x the weight (pg_loss -0.57 here), the long-episode bias episode_mean removes."""
    cfg = _cfg(1)
    cfg.trainer.algorithm.loss_agg = "episode_mean"
    cfg.trainer.algorithm.loss = "ppo_clip"
    group = TrainerGroup(cfg)
    try:
        turns = _samples(5)
        for s, (episode, reward) in zip(turns, [("A", 1.0)] * 3 + [("B", 0.0), ("C", 0.0)], strict=True):
            s.episode_id, s.group_id, s.reward = episode, "g", reward
        for s, lp in zip(turns, group.compute_logprobs(turns), strict=True):
            s.logprobs = lp
        m = group.train_step(turns)
    finally:
        group.shutdown()
    assert m["train/pg_loss"] == pytest.approx(0.0, abs=1e-5) and m["train/grad_norm"] > 0, m
