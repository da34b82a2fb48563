"""The `megatron` training backend: Megatron-Core tensor (and sequence) parallelism over HF checkpoints.

Models come from HF checkpoints through mbridge (`megatron_bridge.py`): Transformer Engine layers on
accelerators, Megatron's local layers without TE (CPU). The policy is wrapped in Megatron's
`DistributedDataParallel` (contiguous grad buffers, distributed optimizer per config) and stepped by
`get_megatron_optimizer`; log-probs and entropies come from the TP-split logits without gathering the vocabulary.

Micro-batches run through Megatron's schedules (`megatron_schedule.py`): 1F1B across pipeline stages, the
worker's loss on the last stage. Not supported yet (clear errors): context parallelism; interleaved (virtual)
pipeline stages are not configurable.
On a CPU-only torch build Megatron-Core also needs its hard-coded CUDA calls mapped to the CPU, which only the
test shim (tests/megatron_cpu) does.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from agentrl.config.schema import OptimConfig
from agentrl.trainer.backends import ModelBackend, Role, TrainOptimizer
from agentrl.trainer.backends.megatron_bridge import (
    add_value_head,
    block_mask,
    hf_metas,
    is_packed,
    local_layer_overrides,
    make_bridge,
    output_positions,
    rope_positions,
    thd_params,
    vocab_parallel_logprobs,
)
from agentrl.trainer.backends.megatron_schedule import run_schedule
from agentrl.trainer.losses import MODEL_DIST, SamplingDist
from agentrl.trainer.model import loss_positions
from agentrl.trainer.optim import lr_factor
from agentrl.trainer.sharding import resolve_checkpointing, resolve_dtype


def _unwrap(model: nn.Module) -> nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    from mbridge.core.util import unwrap_model

    return unwrap_model(model)


class MegatronTrainOptimizer(TrainOptimizer):
    """Megatron's optimizer (clipping inside) with agentrl's lr schedule applied to every param group."""

    def __init__(self, model: nn.Module, opt, peak_lr: float, warmup: int, total: int, schedule: str) -> None:
        self.model, self.opt = model, opt
        self.peak_lr, self.warmup, self.total, self.schedule = peak_lr, warmup, total, schedule
        self.steps = 0

    @property
    def lr(self) -> float:
        return self.peak_lr * lr_factor(self.steps, self.warmup, self.total, self.schedule)

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.opt.zero_grad()

    def step(self) -> float:
        from megatron.core.distributed import finalize_model_grads

        # DP reduction (finish_grad_sync) plus the TP all-reduce of replicated weights that see only this rank's
        # heads (qk layer norms) and of tied embeddings across pipeline stages.
        finalize_model_grads([self.model])
        lr = self.lr
        for group in self.opt.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
        _, grad_norm, _ = self.opt.step()
        self.steps += 1
        return float(grad_norm or 0.0)

    def sync_from_model(self) -> None:
        """Main (fp32) params copied from the model's: another optimizer (the warm start's) moved the weights
        since this one was built, and under bf16 its own main params would overwrite them at its first step."""
        self.opt.reload_model_params()

    def state_dict(self) -> dict:
        return {"steps": self.steps, "peak_lr": self.peak_lr}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])


class MegatronBackend(ModelBackend):
    def __init__(self, cfg, model_path: str, device: torch.device, platform) -> None:
        from megatron.core import parallel_state as mpu
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        self.cfg, self.model_path, self.device, self.platform = cfg, model_path, device, platform
        mc = cfg.trainer.megatron
        if mc.context_parallel > 1:
            raise NotImplementedError("megatron backend: context_parallel > 1 is not supported yet")
        if not mpu.model_parallel_is_initialized():
            mpu.initialize_model_parallel(
                tensor_model_parallel_size=mc.tensor_parallel,
                pipeline_model_parallel_size=mc.pipeline_parallel,
                context_parallel_size=mc.context_parallel,
                expert_model_parallel_size=mc.expert_parallel,
                create_gloo_process_groups=True,
            )
        model_parallel_cuda_manual_seed(cfg.seed)
        self.mpu = mpu
        self.tp_size = mpu.get_tensor_model_parallel_world_size()
        self.dp_rank = mpu.get_data_parallel_rank()
        self.dp_size = mpu.get_data_parallel_world_size()
        self.dp_group = mpu.get_data_parallel_group_gloo() if mc.model_parallel > 1 else None
        self.dtype = resolve_dtype(cfg.trainer, platform)
        self.sequence_parallel = mc.sequence_parallel and self.tp_size > 1
        # Transformer Engine layers where TE is installed (CUDA only); Megatron's local layers elsewhere, e.g. a GPU
        # image without TE (slower: no fused attention or kernels, but the same model and numbers)
        use_te = platform.kind == "cuda" and importlib.util.find_spec("transformer_engine") is not None
        if self.sequence_parallel and not use_te:
            raise NotImplementedError(
                "megatron backend: sequence_parallel needs Transformer Engine layers (CUDA); Megatron's local "
                "layer norms do not support it"
            )
        extra = {} if use_te else local_layer_overrides()
        # perform_initialization stays on: without it megatron-core never marks weights tensor-parallel.
        # calculate_per_token_loss: no division by the micro-batch count, DDP sums over replicas (each micro-batch's
        # loss is already its share of the global loss).
        extra.update(sequence_parallel=self.sequence_parallel, calculate_per_token_loss=True)
        if resolve_checkpointing(cfg.trainer, platform):
            extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        self.bridge = make_bridge(model_path, self.dtype, use_te=use_te, **extra)
        self._metas: list | None = None

    def close(self) -> None:
        """Megatron's parallel state is module-global: a later backend in this process starts from scratch."""
        self.mpu.destroy_model_parallel()

    # ------------------------------------------------------------------------------------------ models

    def build(self, role: Role) -> nn.Module:
        from megatron.core import tensor_parallel
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.transformer.module import Float16Module

        mpu = self.mpu
        provider = self.bridge._model_provider([])
        gpt = provider(pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage())
        for p in gpt.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
        if self.device.type != "cpu":
            gpt = gpt.to(self.device)
        self.bridge.load_weights([gpt], self.model_path)
        if role == "critic":
            add_value_head(gpt, self.bridge.config)
            gpt.agentrl_critic = True
        elif self._metas is None:
            self._metas = self._gather_metas(gpt)
        model: nn.Module = gpt
        if self.dtype in (torch.bfloat16, torch.float16):
            model = Float16Module(self.bridge.config, model)
        if role == "reference":
            model.eval()
            for p in model.parameters():
                p.requires_grad_(False)
            return model
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.cfg.trainer.megatron.distributed_optimizer,
        )
        model = DistributedDataParallel(self.bridge.config, ddp_config, model)
        model.train()
        return model

    def _gather_metas(self, gpt: nn.Module) -> list:
        local = hf_metas(self.bridge, gpt, self.tp_size)
        pp = self.mpu.get_pipeline_model_parallel_world_size()
        if pp == 1:
            return local
        parts: list = [None] * pp
        dist.all_gather_object(parts, local, group=self.mpu.get_pipeline_model_parallel_group())
        return [m for part in parts for m in part]

    # ------------------------------------------------------------------------------------------ forward

    def forward_backward(self, model, batches, loss_fn=None, forward_only=False, with_entropy=False, entropy_grad=True,
                         sampling_dist=MODEL_DIST):  # fmt: skip
        step = partial(
            self._step, critic=getattr(_unwrap(model), "agentrl_critic", False), with_entropy=with_entropy,
            entropy_grad=entropy_grad, sampling_dist=sampling_dist,
        )  # fmt: skip
        with torch.no_grad() if forward_only else nullcontext():
            return run_schedule(step, model, batches, loss_fn, forward_only, self.device)

    def _step(self, model, batch, critic: bool, with_entropy: bool, entropy_grad: bool, sampling_dist: SamplingDist):
        """One micro-batch's forward on this stage: its output, and the function the last stage turns that output
        into per-token log-probs and entropies (TP-split logits; the vocabulary is gathered only for top-k / top-p)
        or values with."""
        ids = batch["input_ids"]
        T = ids.shape[1]
        targets = None if critic else loss_positions(batch)
        if targets is None and not critic:
            targets = torch.arange(1, T, device=ids.device)
        # the LM head only where a logit is needed (sequence parallel: the output layer sees a sequence shard)
        positions = None if critic or self.sequence_parallel else targets - 1
        out = self._forward(model, batch, positions)

        def post(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            if critic:  # V after token t is the value head at t; aligned as model._shift_align
                v = out[:, :T, 0].float()
                return torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1), None
            z = (out if positions is not None else out[:, :T][:, targets - 1]).float()
            logp, ent = vocab_parallel_logprobs(z, ids[:, targets], with_entropy, entropy_grad, sampling_dist)
            zeros = logp.new_zeros(ids.shape)
            ent = zeros.index_copy(1, targets, ent) if ent is not None else None
            return zeros.index_copy(1, targets, logp), ent

        return out, post

    def _forward(
        self, model: nn.Module, batch: dict[str, torch.Tensor], positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """This stage's output for a pad or packed micro-batch: on the last stage the output layer [rows, T', out]
        (TP-split logits, or the critic's value; T' >= T under sequence parallelism), with `positions` [rows,
        len(positions), out] computed at those positions only; elsewhere the hidden states for the next stage."""
        ids, pos = batch["input_ids"], batch["position_ids"]
        T = ids.shape[1]
        pad = (-T) % self.tp_size if self.sequence_parallel else 0  # sequence parallel splits T over TP
        if pad:
            ids, pos = nn.functional.pad(ids, (0, pad)), nn.functional.pad(pos, (0, pad))
        last = self.mpu.is_pipeline_last_stage()
        with output_positions(_unwrap(model), positions if last else None):
            if not is_packed(batch):  # right-padded rows: causal attention is exact for every real token
                out = model(input_ids=ids, position_ids=pos, attention_mask=None)
            elif self.bridge.use_te:  # TE: variable-length (THD) attention, RoPE restarted per sequence
                out = model(input_ids=ids, position_ids=pos, attention_mask=None, packed_seq_params=thd_params(batch))
            else:  # local layers: the block-diagonal mask and RoPE at the position ids
                attn = ~block_mask(batch)  # Megatron: True = masked out
                if pad:
                    attn = nn.functional.pad(attn, (0, pad, 0, pad), value=True)
                with rope_positions(_unwrap(model), pos):
                    out = model(input_ids=ids, position_ids=pos, attention_mask=attn)
        return out

    # ------------------------------------------------------------------------------------------ optimizer

    def optimizer(self, model: nn.Module, total_steps: int, optim: OptimConfig | None = None) -> TrainOptimizer:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        oc = optim or self.cfg.trainer.optim
        peak = oc.lr
        config = OptimizerConfig(
            optimizer="adam",
            lr=peak,
            weight_decay=oc.weight_decay,
            adam_beta1=oc.betas[0],
            adam_beta2=oc.betas[1],
            adam_eps=oc.eps,
            clip_grad=oc.grad_clip,
            bf16=self.dtype == torch.bfloat16,
            params_dtype=self.dtype,
            use_distributed_optimizer=self.cfg.trainer.megatron.distributed_optimizer,
        )
        # config_overrides={}: weight decay on every parameter, as torch AdamW in the fsdp2 backend does.
        opt = get_megatron_optimizer(config, [model], config_overrides={})
        return MegatronTrainOptimizer(model, opt, peak, oc.warmup_steps, total_steps, oc.schedule)

    # ------------------------------------------------------------------------------------------ weights

    def weight_metas(self, model: nn.Module, tied: bool) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        assert self._metas is not None, "build a model first"
        return list(_dedup(self._metas, tied, key=lambda m: m[0]))

    def full_weights(self, model: nn.Module, tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
        stream = ((n, t.detach()) for n, t in self.bridge.export_weights([model]))
        yield from _dedup(stream, tied, key=lambda m: m[0])

    # ------------------------------------------------------------------------------------------ checkpoints

    def save_checkpoint(
        self, ckpt_dir: str, models: dict[str, nn.Module], optimizers: dict[str, TrainOptimizer], extra: dict
    ) -> None:
        """One Megatron distributed checkpoint per model (`<ckpt>/<role>`) and per optimizer (`<ckpt>/<name>`, its
        sharded state against its own model's), schedules in schedules.json, `extra` per rank."""
        from megatron.core import dist_checkpointing

        rank = dist.get_rank()
        states = {role: {"model": _unwrap(model).sharded_state_dict()} for role, model in models.items()}
        for name, opt in optimizers.items():
            msd = _unwrap(opt.model).sharded_state_dict()
            states[name] = {"optimizer": opt.opt.sharded_state_dict(msd, metadata=_OPT_CKPT_METADATA)}
        for name, state in states.items():
            path = os.path.join(ckpt_dir, name)
            if rank == 0:
                os.makedirs(path, exist_ok=True)
            dist.barrier()
            dist_checkpointing.save(state, path)
        if rank == 0:
            sched = {name: o.state_dict() for name, o in optimizers.items()}
            with open(os.path.join(ckpt_dir, "schedules.json"), "w") as fh:
                json.dump(sched, fh)
            info = {"format": "megatron-torch_dist", "hf_path": self.model_path, "roles": sorted(models)}
            with open(os.path.join(ckpt_dir, "megatron.json"), "w") as fh:
                json.dump(info, fh)
        torch.save(extra, os.path.join(ckpt_dir, f"extra_rank{rank}.pt"))
        dist.barrier()

    def load_checkpoint(
        self, ckpt_dir: str, models: dict[str, nn.Module], optimizers: dict[str, TrainOptimizer]
    ) -> dict:
        from megatron.core import dist_checkpointing

        with open(os.path.join(ckpt_dir, "schedules.json")) as fh:
            sched = json.load(fh)
        for role, model in models.items():
            inner = _unwrap(model)
            loaded = dist_checkpointing.load({"model": inner.sharded_state_dict()}, os.path.join(ckpt_dir, role))
            inner.load_state_dict(loaded["model"])
        for name, opt in optimizers.items():
            if name not in sched:
                continue
            _init_states(opt.opt)
            msd = _unwrap(opt.model).sharded_state_dict()
            state = {"optimizer": opt.opt.sharded_state_dict(msd, is_loading=True, metadata=_OPT_CKPT_METADATA)}
            loaded = dist_checkpointing.load(state, os.path.join(ckpt_dir, name))
            with torch.no_grad():  # fp32 main params are views of the (leaf) model params
                opt.opt.load_state_dict(loaded["optimizer"])
            _unshare_steps(opt.opt)
            opt.load_state_dict(sched[name])
        return torch.load(os.path.join(ckpt_dir, f"extra_rank{dist.get_rank()}.pt"), weights_only=False)


# dp_reshardable: fully parallel save and load, reloadable at another data-parallel size (not another TP/PP
# split). megatron-core 0.16's default layout uses ShardedTensor.flattened_range, which its own save rejects, and
# fully_reshardable fails to load without TE/Apex (KeyError 'step').
_OPT_CKPT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _init_states(opt) -> None:
    """A fresh distributed optimizer has no Adam state to load into (its state_dict asserts on the step):
    Megatron's own dummy initialisation, one step on zero grads, here at lr 0 so no parameter moves."""
    for sub in getattr(opt, "chained_optimizers", [opt]):
        init = getattr(sub, "_init_optimizer_states_with_dummy_values", None)
        if init is None or len(sub.optimizer.state) > 0:
            continue
        lrs = [g["lr"] for g in sub.optimizer.param_groups]
        for g in sub.optimizer.param_groups:
            g["lr"] = 0.0
        init()
        for g, lr in zip(sub.optimizer.param_groups, lrs, strict=True):
            g["lr"] = lr


def _unshare_steps(opt) -> None:
    """Without TE/Apex, megatron-core 0.16's distributed optimizer loads one `step` tensor into every
    parameter's Adam state; torch's AdamW increments it in place per parameter, which would skew the bias
    correction of every later step. Give each parameter its own copy."""
    for sub in getattr(opt, "chained_optimizers", [opt]):
        inner = getattr(sub, "optimizer", None)
        for state in getattr(inner, "state", {}).values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def _dedup(items, tied: bool, key):
    """HF names once each (a tied output layer maps onto the embedding again); a tied lm_head left out."""
    seen = set()
    for item in items:
        name = key(item)
        if name in seen or (tied and name == "lm_head.weight"):
            continue
        seen.add(name)
        yield item
