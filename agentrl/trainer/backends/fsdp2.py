"""The FSDP2 backend: every rank is a data-parallel replica holding a shard of every parameter.

Models come from `agentrl.trainer.sharding.build_sharded` (meta-device skeleton, rank 0's checkpoint broadcast
into the shards), forward passes from `agentrl.trainer.model`, checkpoints are torch.distributed.checkpoint
(DCP) shards of models and optimizers, which `agentrl.trainer.checkpoint.export_hf` turns back into an HF dir.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from agentrl.config.schema import OptimConfig
from agentrl.trainer import lora
from agentrl.trainer.backends import ModelBackend, Role, TrainOptimizer
from agentrl.trainer.losses import MODEL_DIST
from agentrl.trainer.model import ValueModel, forward_logprobs, forward_values, shares_prompts, sharing_plan
from agentrl.trainer.optim import build_optimizer, clip_grad_norm
from agentrl.trainer.prompt_sharing import SharingPlan, model_calls
from agentrl.trainer.sharding import build_sharded


class FSDP2Optimizer(TrainOptimizer):
    """AdamW + LambdaLR over one FSDP2 model; clipping uses the global norm of the sharded gradients."""

    def __init__(self, model: nn.Module, cfg: OptimConfig, total_steps: int) -> None:
        self.model, self.grad_clip = model, cfg.grad_clip
        self.optimizer, self.schedule = build_optimizer(model.parameters(), cfg, total_steps)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> float:
        norm = clip_grad_norm(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.schedule.step()
        return norm

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]


def sharded_named_params(model: nn.Module, tied: bool) -> list[tuple[str, torch.Tensor]]:
    """The model's weights under HF names (FSDP and activation-checkpoint wrappers stripped), still sharded; a
    tied lm_head is left out (the engine re-ties it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    return [(k, v) for k, v in state.items() if not (tied and k == "lm_head.weight")]


def reshard(model: nn.Module) -> None:
    """Every FSDP2 unit of `model` back to its sharded parameters, before anything collects `model.parameters()`.
    A forward without backward leaves the root unit's parameters unsharded (FSDP2 keeps them for a backward that
    never comes; the next forward reuses them, current as long as no step ran between): an optimizer built then
    would hold those temporary copies and its steps would never reach the model (measured: an SFT whose first forward
    ran under no_grad stayed at loss 4.25 for 30 steps, 0.68 otherwise)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """Collective for a DTensor (every rank must call it, in the same order): the whole tensor."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _lora_name(name: str) -> str:
    return lora.peft_name(name) if lora.is_adapter(name) else lora.hf_name(name)


class FSDP2Backend(ModelBackend):
    def __init__(self, cfg: Any, model_path: str, device: torch.device, platform: Any) -> None:
        self.tc, self.model_path, self.device, self.platform = cfg.trainer, model_path, device, platform
        self.dp_rank, self.dp_size, self.dp_group = dist.get_rank(), dist.get_world_size(), None

    def build(self, role: Role) -> nn.Module:
        return build_sharded(self.model_path, self.device, self.tc, self.platform, role)

    def build_policy(self, path: str, adapters: bool) -> nn.Module:
        """The policy from the HF model at `path`, with `trainer.lora`'s adapters or without any (a LoRA run's
        full warm start fine-tunes the plain model, then its result becomes the adapters' base)."""
        tc = self.tc if adapters else self.tc.model_copy(update={"lora": None})
        return build_sharded(path, self.device, tc, self.platform, "policy")

    def optimizer(self, model: nn.Module, total_steps: int, optim: OptimConfig | None = None) -> FSDP2Optimizer:
        reshard(model)  # its parameters() must be the sharded ones the steps update, whatever ran before
        return FSDP2Optimizer(model, optim or self.tc.optim, total_steps)

    def shares_prompts(self, model: nn.Module, grad: bool) -> bool:
        return shares_prompts(model, grad)

    def forward_backward(self, model, batches, loss_fn=None, forward_only=False, with_entropy=False, entropy_grad=True,
                         sampling_dist=MODEL_DIST):  # fmt: skip
        """One micro-batch after another; the loss times `dp_size` because FSDP2 averages gradients over ranks."""
        results: list = []
        with torch.no_grad() if forward_only else nullcontext():
            for batch in batches:
                if isinstance(model, ValueModel):
                    out, ent = forward_values(model, batch), None
                else:
                    plan = self._agreed_plan(model, batch)
                    out, ent = forward_logprobs(
                        model, batch, with_entropy, sampling_dist, entropy_grad=entropy_grad, plan=plan
                    )
                if loss_fn is None:
                    results.append(out)
                    continue
                loss, sums = loss_fn(batch, out, ent)
                if not forward_only:
                    (loss * self.dp_size).backward()
                results.append({k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in sums.items()})
        return results

    def _agreed_plan(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> SharingPlan | None:
        """The micro-batch's prompt-sharing plan when every rank's makes the same model calls, else the plain
        pass on all of them. A padding micro-batch (one rank has fewer) or a single row runs plain, a neighbour's
        shared prompts two or three calls: their all-gathers would pair up wrongly and hang or mix the ranks."""
        plan = sharing_plan(model, batch)
        if self.dp_size == 1:
            return plan
        code = model_calls(model, plan)
        both = torch.tensor([code, -code])
        dist.all_reduce(both, dist.ReduceOp.MAX, group=self.dp_group)  # host data: over gloo
        return plan if int(both[0]) == -int(both[1]) else None

    def weight_metas(self, model, tied):
        metas = [(k, tuple(v.shape), v.dtype) for k, v in sharded_named_params(model, tied)]
        return lora.hf_metas(metas) if self._adapters(model) else metas

    def full_weights(self, model, tied) -> Iterator[tuple[str, torch.Tensor]]:
        """The whole weights in `weight_metas` order; with LoRA, merged (what the engines and exports get)."""
        full = ((k, full_tensor(v)) for k, v in sharded_named_params(model, tied))
        return lora.merged(full, lora.scaling(self.tc.lora)) if self._adapters(model) else full

    def lora_metas(self, model, tied, base: bool, adapters: bool) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """`lora_weights`' names, shapes and dtypes, without communication."""
        return [(_lora_name(k), tuple(v.shape), v.dtype) for k, v in sharded_named_params(model, tied)
                if (adapters if lora.is_adapter(k) else base)]  # fmt: skip

    def lora_weights(self, model, tied, base: bool, adapters: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: with `adapters` the adapters in full under peft's saved names (what engines serving them
        load), with `base` the frozen base weights (unmerged) under the HF names, in `lora_metas` order."""
        return ((_lora_name(k), full_tensor(v)) for k, v in sharded_named_params(model, tied)
                if (adapters if lora.is_adapter(k) else base))  # fmt: skip

    def _adapters(self, model: nn.Module) -> bool:
        return lora.has_adapters(model)

    def save_checkpoint(self, ckpt_dir, models, optimizers, extra) -> None:
        """DCP shards of every model and optimizer; schedules and `extra` in `extra_rank{R}.pt`."""
        import torch.distributed.checkpoint as dcp

        Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
        dcp.save(self._state(models, optimizers), checkpoint_id=str(ckpt_dir))
        schedules = {name: opt.schedule.state_dict() for name, opt in optimizers.items()}
        torch.save({**extra, "schedules": schedules}, Path(ckpt_dir) / f"extra_rank{dist.get_rank()}.pt")

    def load_checkpoint(self, ckpt_dir, models, optimizers) -> dict:
        """Loads into `models` and `optimizers` (those the caller passes: the ones the checkpoint holds); returns
        this rank's `extra` (rank 0's when the world grew)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        state = self._state(models, optimizers)
        dcp.load(state, checkpoint_id=str(ckpt_dir))
        for name, model in models.items():
            # a policy with adapters saved them alone: its base is the frozen one it was built from
            strict = StateDictOptions(strict=not lora.has_adapters(model))
            set_model_state_dict(model, state[_key(name)], options=strict)
        for name, opt in optimizers.items():
            set_optimizer_state_dict(opt.model, opt.optimizer, state[name])
        path = Path(ckpt_dir) / f"extra_rank{dist.get_rank()}.pt"
        if not path.exists():
            path = Path(ckpt_dir) / "extra_rank0.pt"
        extra = torch.load(path, weights_only=False)
        for name, sched in extra.pop("schedules", {}).items():
            if name in optimizers:
                optimizers[name].schedule.load_state_dict(sched)
        return extra

    @staticmethod
    def _state(models: dict[str, nn.Module], optimizers: dict[str, FSDP2Optimizer]) -> dict[str, Any]:
        """The DCP state: the policy under 'model' (the key `export_hf` reads), other models and optimizers
        under their names. A policy with LoRA adapters keeps only them: its base never changes in RL, and the
        checkpoint's meta.json names the dir it came from."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state: dict[str, Any] = {}
        for name, model in models.items():
            weights = get_model_state_dict(model)
            if lora.has_adapters(model):
                weights = {k: v for k, v in weights.items() if lora.is_adapter(k)}
            state[_key(name)] = weights
        for name, opt in optimizers.items():
            state[name] = get_optimizer_state_dict(opt.model, opt.optimizer)
        return state


def _key(model_name: str) -> str:
    return "model" if model_name == "policy" else model_name
