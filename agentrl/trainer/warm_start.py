"""A trainer rank's side of the SFT warm start: its steps on expert demos and its end.

A mixin of `TrainerRank` (the Ray actor), kept apart from the RL steps; it uses the rank's `backend`, `tc`, `model`,
`opt`, `sft_opt`, `alg`, `optimizer_steps`, its batch plumbing (`_plan`, `_shares_prompts`, `_micro_batches`) and
`save_warm_start` (`WeightPublisher`). With trainer.lora's full warm start the steps fine-tune the plain model (the
policy is rebuilt without adapters at the first step), and `end_warm_start` rebuilds it with fresh adapters on the
result.
"""

from __future__ import annotations

import os
import time
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from agentrl.config.schema import TrainerConfig
from agentrl.trainer import loss_terms
from agentrl.trainer.backends import TrainOptimizer
from agentrl.trainer.collectives import RankSums, host_all_reduce
from agentrl.trainer.loss_terms import SFT_SUMS
from agentrl.types import Sample


class WarmStartSteps:
    tc: TrainerConfig
    alg: Any
    backend: Any
    model: torch.nn.Module
    opt: TrainOptimizer
    sft_opt: TrainOptimizer | None
    model_path: str
    base_path: str
    rank: int
    optimizer_steps: int

    def sft_step(self, samples: list[Sample]) -> dict[str, float]:
        """Cross-entropy on loss-mask tokens, token-mean over the batch; its own AdamW at trainer.sft.lr.
        A warm start, not an RL batch: it leaves the policy version alone."""
        t0 = time.perf_counter()
        if self.sft_opt is None:
            if self._full_warm_start():  # fine-tune the plain model; end_warm_start puts the adapters back
                del self.model, self.opt
                self.model = self.backend.build_policy(self.model_path, adapters=False)
            self.sft_opt = self._sft_optimizer()
        mbs = self._plan(samples, shared=self._shares_prompts(grad=True))
        fields = {"loss_mask": {i: s.loss_mask for i, s in enumerate(samples)}}
        denom = float(sum(sum(s.loss_mask[1:]) for s in samples))
        self.model.train()
        self.sft_opt.zero_grad()
        sums = RankSums(SFT_SUMS, self.backend.dp_group)
        batches = self._micro_batches(samples, mbs, fields)
        for row in self.backend.forward_backward(self.model, batches, partial(loss_terms.sft_loss, denom=denom)):
            sums.add(row)
        lr = self.sft_opt.lr
        norm = self.sft_opt.step()
        self.optimizer_steps += 1
        m = sums.all_reduce()
        elapsed = time.perf_counter() - t0
        n_tokens = sum(len(s.token_ids) for s in samples)
        return {
            "sft/loss": m["loss"],
            "sft/token_acc": m["correct"] / max(denom, 1.0),
            "sft/grad_norm": norm,
            "sft/lr": lr,
            "timing/sft_step": elapsed,
            "sft/tokens_per_s": n_tokens / elapsed,
        }

    def _full_warm_start(self) -> bool:
        return self.tc.lora is not None and self.tc.lora.warm_start == "full"

    def end_warm_start(self, path: str) -> bool:
        """Collective, after the last sft_step. With trainer.lora and a full warm start: the fine-tuned weights
        are saved at `path` (as `save_warm_start`) and become the base of a policy with fresh adapters (B = 0, so
        it computes what the warm start left) and a fresh RL optimizer. Otherwise only saves them. Returns whether
        this call wrote `path` (rank 0)."""
        saved = self.save_warm_start(path)
        if self._full_warm_start() and self.sft_opt is not None:
            self.sft_opt = None  # its state is the plain model's: the RL run goes on with the adapters only
            self._rebase(path)
        return saved

    def _rebase(self, path: str) -> None:
        """Collective: the policy rebuilt with fresh adapters on the HF model at `path`, and a fresh RL optimizer
        (after a full warm start; or before a checkpoint's adapters load onto the base they were trained on)."""
        # Rank 0 reads the base; every rank learns whether it is there, so all raise together (none waits in the
        # build's broadcast for a rank 0 that gave up).
        gone = torch.tensor([int(self.rank == 0 and not os.path.exists(os.path.join(path, "config.json")))])
        if dist.is_initialized():
            host_all_reduce(gone)
        if gone.item():
            raise FileNotFoundError(f"the LoRA base {path} is gone (a full warm start's weights, which the "
                                    "checkpoints of this run do not hold): restore it to resume or export")  # fmt: skip
        del self.model
        self.opt = None  # type: ignore[assignment]  # the old one holds the old policy's parameters
        self.model = self.backend.build_policy(path, adapters=True)
        steps = self.tc.total_steps * self.alg.ppo_epochs * self.alg.mini_batches
        self.opt = self.backend.optimizer(self.model, steps)
        self.base_path = os.path.abspath(path)

    def _sft_optimizer(self) -> TrainOptimizer:
        """AdamW at trainer.sft.lr, constant: the warm start keeps trainer.optim's betas, eps, decay and clipping,
        not the RL run's warmup and schedule (which count RL steps)."""
        sft = self.tc.optim.model_copy(update={"lr": self.tc.sft.lr, "schedule": "constant", "warmup_steps": 0})
        return self.backend.optimizer(self.model, max(self.tc.sft.steps, 1), sft)
