"""Training backends: what a trainer rank's RL and SFT logic needs from a parallel training library.

`agentrl.trainer.worker.TrainerRank` holds the algorithm (advantages, losses, mini-batches, metrics) once; a
backend owns everything that depends on how the model is split over ranks: building the policy, reference and
critic, forward and backward over a step's micro-batches (the worker's loss function inside the backend's
schedule), optimizer steps, full weights for export and sync, and checkpoints.

- `fsdp2`: every rank holds a shard of every parameter (data parallel over all ranks).
- `megatron`: Megatron-Core tensor / pipeline / context / expert parallelism; the data-parallel replicas are the
  rank count divided by the model-parallel sizes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
from torch import nn

from agentrl.config.schema import OptimConfig
from agentrl.trainer.losses import MODEL_DIST, SamplingDist

Role = Literal["policy", "reference", "critic"]
Batch = dict[str, torch.Tensor]
# loss_fn(batch, out, ent) -> (loss, sums): `out` the per-token log-probs (policy, reference) or values (critic),
# `ent` the entropies (None unless asked for); `loss` this micro-batch's share of the global loss (the shares
# over micro-batches and data-parallel replicas add up to it), `sums` named per-micro-batch statistics.
LossFn = Callable[[Batch, torch.Tensor, "torch.Tensor | None"], tuple[torch.Tensor, dict[str, Any]]]


class TrainOptimizer(ABC):
    """One optimizer with its learning-rate schedule and gradient clipping, as a step drives it; `model` is the
    model it steps."""

    model: nn.Module

    @abstractmethod
    def zero_grad(self) -> None: ...

    @abstractmethod
    def step(self) -> float:
        """Finish gradient reduction, clip to `optim.grad_clip`, step, advance the schedule; returns the global
        grad norm before clipping (collective)."""

    @property
    @abstractmethod
    def lr(self) -> float:
        """The learning rate the next `step` applies."""

    def sync_from_model(self) -> None:
        """Take the model's current weights as this optimizer's starting point (another optimizer changed them
        since it was built). Nothing to do where the optimizer steps the model's own parameters."""
        return None


class ModelBackend(ABC):
    """Per-rank handle on the parallel library. Created after the default process group exists.

    Data parallelism: the batch is split over `dp_size` replicas; this rank trains on shard `dp_rank`, and every
    rank of one replica (its tensor / pipeline peers) sees the same micro-batches. A micro-batch's loss is its
    share of the global loss; `forward_backward` makes the gradients the sum of the shares. Host bookkeeping
    (loss sums, denominators) is reduced over `dp_group`: the gloo group of the ranks at this rank's model-parallel
    position, one per replica (None: the default group, when every rank is a replica of its own).
    """

    dp_rank: int = 0
    dp_size: int = 1
    dp_group: Any = None

    @abstractmethod
    def build(self, role: Role) -> nn.Module:
        """The policy or critic ready to train (fp32 master weights), or the reference (eval mode, no grads),
        filled from the HF checkpoint. Collective."""

    @abstractmethod
    def optimizer(self, model: nn.Module, total_steps: int, optim: OptimConfig | None = None) -> TrainOptimizer:
        """AdamW over `model` with `optim`'s settings and schedule (default `trainer.optim`)."""

    @abstractmethod
    def forward_backward(
        self,
        model: nn.Module,
        batches: Sequence[Batch],
        loss_fn: LossFn | None = None,
        forward_only: bool = False,
        with_entropy: bool = False,
        entropy_grad: bool = True,
        sampling_dist: SamplingDist = MODEL_DIST,
    ) -> list[Any]:
        """Forward (and, unless `forward_only`, backward) of every micro-batch in `batches`, gradients summed
        over micro-batches and replicas. The backend drives the micro-batches because a pipeline-parallel
        schedule interleaves them across stages and computes the loss on the last stage only.

        Per micro-batch, on every rank of the replica: with `loss_fn`, its `sums` (detached); without, the
        per-token output [rows, T] aligned with batch['input_ids'] as in `agentrl.trainer.model.forward_logprobs`
        / `forward_values` (log-probs 0 outside the loss positions). Log-probs and entropies are of
        `sampling_dist`: the model's own distribution, or the one the engines sample from (`SamplingDist`).
        `batches` may collate lazily: each item is read once per pass, in order."""

    def shares_prompts(self, model: nn.Module, grad: bool) -> bool:
        """Whether `forward_backward` runs a micro-batch's repeated prompts once (then the micro-batch planner
        counts them once against `trainer.micro_batch_tokens`)."""
        return False

    @abstractmethod
    def weight_metas(self, model: nn.Module, tied: bool) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """HF names, full shapes and dtypes of the policy's weights, in `full_weights` order, without
        communication; a tied lm_head is left out (engines re-tie it)."""

    @abstractmethod
    def full_weights(self, model: nn.Module, tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective (every rank iterates to the end, in step): each HF-named weight in full, in `weight_metas`
        order, on this rank's device. Only rank 0's tensors are used."""

    @abstractmethod
    def save_checkpoint(
        self, ckpt_dir: str, models: dict[str, nn.Module], optimizers: dict[str, TrainOptimizer], extra: dict
    ) -> None:
        """Collective: models ('policy', 'critic') and named optimizers ('optim', 'sft_optim', 'critic_optim';
        each knows its `model`) with their schedules under `ckpt_dir`, plus this rank's `extra` (RNG, counters)."""

    def close(self) -> None:
        """Free what the backend set up beside the default process group (before it is destroyed)."""
        return None

    @abstractmethod
    def load_checkpoint(
        self, ckpt_dir: str, models: dict[str, nn.Module], optimizers: dict[str, TrainOptimizer]
    ) -> dict:
        """Collective inverse of `save_checkpoint` for the optimizers the checkpoint holds; returns `extra`."""


def create_backend(name: str, cfg: Any, model_path: str, device: torch.device, platform: Any) -> ModelBackend:
    """The backend `trainer.backend` names (imported lazily: Megatron-Core is an extra)."""
    if name == "fsdp2":
        from agentrl.trainer.backends.fsdp2 import FSDP2Backend

        return FSDP2Backend(cfg, model_path, device, platform)
    if name == "megatron":
        from agentrl.trainer.backends.megatron import MegatronBackend

        return MegatronBackend(cfg, model_path, device, platform)
    raise ValueError(f"unknown trainer.backend {name!r} (fsdp2 or megatron)")
