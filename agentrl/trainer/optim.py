"""AdamW and the learning-rate schedule (linear warmup, then constant / linear decay / cosine to zero)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from agentrl.config.schema import OptimConfig


def lr_factor(step: int, warmup: int, total: int, schedule: str) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(total - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr schedule {schedule!r}")


def build_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: OptimConfig, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with its scheduler. Fused (one kernel for all parameters) where the parameters live on CUDA; the
    plain loop elsewhere: on CPU it is no slower and keeps DTensor params simple, and with CPU offload the params
    (and so the step) are on the host. NPU keeps the plain loop too: torch_npu's fused AdamW is unverified here.
    """
    if cfg.lr is None:
        raise ValueError("OptimConfig.lr is unset: a Config fills it from model.path; pass lr to a bare OptimConfig")
    trainable = [p for p in params if p.requires_grad]
    fused = bool(trainable) and trainable[0].device.type == "cuda"
    opt = torch.optim.AdamW(
        trainable,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        foreach=False if not fused else None,
        fused=fused or None,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg.warmup_steps, total_steps, cfg.schedule))
    return opt, sched


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    """Global grad norm over all ranks (FSDP2 grads are DTensors; the norm comes back as one too)."""
    norm = torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)
