"""The trainer's fast paths change nothing, checked on real batches of every shipped example.

The shared-prompt passes (the tree/trie layout SDPA runs, and the row layout flash kernels run) must give the
plain pass's loss, gradients and optimizer steps. Synthetic batches once passed while real ones were suspected:
these are batches the examples really trained on (`scripts/record_example_batches.py` recorded them with
`logging.save_batches`: turn-wise Sokoban, trajectory-wise Sokoban, the calculator tool example, Sokoban behind
an OpenEnv server), and the SFT warm start's own expert demos, made here from each example's config. Each case
runs a whole `TrainerRank` step (FSDP2, gloo, one rank) twice from the same weights, every pass plain and then
shared, and compares every optimizer step: the summed gradient, the parameters after it, and the step's metrics.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from agentrl.config import load_config
from agentrl.run.batch_files import load_batch
from agentrl.trainer import model as M
from agentrl.trainer import prompt_sharing as PS
from agentrl.trainer.worker import TrainerRank

BATCHES = Path(__file__).parent / "data" / "batches"
EXAMPLES = Path(__file__).parent.parent / "examples"
IN_PROCESS_CALCULATOR = 'tools.sets.calculator.calculator={python: "agentrl.tools.calculator:calculator"}'
RL_EXAMPLES = ["agentic_sokoban", "sokoban_sync", "math_tools", "sokoban_remote_env"]
SFT_EXAMPLES = ["agentic_sokoban", "sokoban_sync", "math_tools"]
METRICS = ("train/loss", "train/pg_loss", "train/entropy", "train/clip_frac", "train/ratio_mean", "train/grad_norm",
           "train/is_weight_mean", "sft/loss", "sft/token_acc", "sft/grad_norm")  # fmt: skip


def _config(name: str):
    overrides = [IN_PROCESS_CALCULATOR] if name == "math_tools" else []
    return load_config(EXAMPLES / f"{name}.yaml", overrides)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class _Recorder:
    """Wraps an optimizer's `step`: the parameters before the first step, and per step the summed gradient
    before it and the parameters after it."""

    def __init__(self, opt) -> None:
        self._step, self._model = opt.step, opt.model
        self.start = self._params()
        self.grads: list[torch.Tensor] = []
        self.params: list[torch.Tensor] = []
        opt.step = self.step

    def _params(self) -> torch.Tensor:
        return torch.cat([_full(p.detach()).flatten() for p in self._model.parameters()]).clone()

    def step(self) -> float:
        ps = list(self._model.parameters())
        self.grads.append(torch.cat([_full(p.grad).flatten() for p in ps if p.grad is not None]).clone())
        norm = self._step()
        self.params.append(self._params())
        return norm


def _run(name: str, samples, kind: str, way: str, model_path: str) -> tuple[dict, _Recorder, int]:
    """One train_step (or sft_step) from the tiny model's weights, every pass `way`: plain, tree or row.
    Returns its metrics, what each optimizer step saw, and how many micro-batches ran a sharing plan."""
    cfg = _config(name)
    rank = TrainerRank(cfg.model_dump(mode="json", by_alias=True), model_path, 0, 1)
    rank.setup("127.0.0.1", 0)
    if kind == "sft":
        rank.sft_opt = rank._sft_optimizer()
    rec = _Recorder(rank.sft_opt if kind == "sft" else rank.opt)
    plans: list = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(M, "plan_sharing", lambda batch: plans.append(PS.plan_sharing(batch)) or plans[-1])
        if way == "plain":
            mp.setattr(PS, "MIN_SHARED_TOKENS", 10**9)
        if way == "row":
            mp.setattr(PS, "_takes_custom_masks", lambda _model: False)
        metrics = rank.sft_step(samples) if kind == "sft" else rank.train_step(samples)
    with contextlib.suppress(Exception):
        rank.backend.close()
    return metrics, rec, sum(p is not None for p in plans)


def _assert_same_steps(name: str, plain: tuple, shared: tuple) -> None:
    (m_a, a, _), (m_b, b, used) = plain, shared
    assert used > 0, f"{name}: no micro-batch ran a sharing plan: the test compared the plain pass with itself"
    assert len(a.grads) == len(b.grads) > 0
    before = a.start
    for k, (ga, gb, pa, pb) in enumerate(zip(a.grads, b.grads, a.params, b.params, strict=True)):
        err = float((ga - gb).norm() / ga.norm())
        assert err < 1e-4, f"{name}: optimizer step {k}: gradients differ by {err:.2e} of their norm"
        da, db = pa - before, pb - before
        moved = float((da - db).norm() / da.norm())  # Adam's sign-like first steps amplify ulps of tiny grads
        assert moved < 1e-2, f"{name}: optimizer step {k}: updates differ by {moved:.2e} of their norm"
        before = pa
    for key in METRICS:
        if key in m_a:
            assert m_b[key] == pytest.approx(m_a[key], rel=1e-4, abs=1e-6), f"{name}: {key}"


@pytest.mark.parametrize("way", ["tree", "row"])
@pytest.mark.parametrize("name", RL_EXAMPLES)
def test_rl_step_on_a_recorded_batch_equals_the_plain_pass(one_rank_group, tiny_model_path, name, way) -> None:
    samples = load_batch(BATCHES / f"{name}.jsonl.gz")
    assert len({s.group_id for s in samples}) >= 2 and sum(s.num_model_tokens for s in samples) > 0
    plain = _run(name, samples, "train", "plain", tiny_model_path)
    shared = _run(name, samples, "train", way, tiny_model_path)
    _assert_same_steps(f"{name} ({way})", plain, shared)


@pytest.mark.parametrize("name", SFT_EXAMPLES)
def test_sft_step_on_expert_demos_equals_the_plain_pass(one_rank_group, tiny_model_path, name) -> None:
    from transformers import AutoTokenizer

    from agentrl.run.warm_start import expert_samples

    cfg = _config(name)
    demos = expert_samples(cfg, AutoTokenizer.from_pretrained(tiny_model_path), 24)
    batch = list(demos[: cfg.trainer.sft.batch_size])
    plain = _run(name, batch, "sft", "plain", tiny_model_path)
    shared = _run(name, batch, "sft", "tree", tiny_model_path)
    _assert_same_steps(f"{name} SFT", plain, shared)


@pytest.mark.parametrize("name", RL_EXAMPLES)
def test_mini_batches_do_not_depend_on_the_micro_batch_plan(one_rank_group, tiny_model_path, name) -> None:
    """A mini-batch (one optimizer step) holds whole groups, dealt by the seed and the policy version only: the
    order the micro-batch planner puts samples in (sorted prompts with sharing, lengths without) changes nothing."""
    import random

    samples = load_batch(BATCHES / f"{name}.jsonl.gz")
    cfg = _config(name)
    rank = TrainerRank(cfg.model_dump(mode="json", by_alias=True), tiny_model_path, 0, 1)
    rank.setup("127.0.0.1", 0)
    shared = [i for mb in rank._plan(samples, shared=True) for i in mb]
    plain = [i for mb in rank._plan(samples, shared=False) for i in mb]
    assert sorted(shared) == sorted(plain) == list(range(len(samples)))
    shuffled = random.Random(0).sample(shared, len(shared))
    parts = rank._mini_batches(samples, shared)
    assert parts == rank._mini_batches(samples, plain) == rank._mini_batches(samples, shuffled)
    assert len(parts) == min(cfg.trainer.algorithm.mini_batches, len({s.group_id for s in samples}))
    for part in parts:
        groups = {samples[i].group_id for i in part}
        assert all(i in part for i, s in enumerate(samples) if s.group_id in groups)  # whole groups
