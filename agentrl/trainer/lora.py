"""LoRA (trainer.lora): peft's low-rank adapters injected into the policy, the base frozen.

The adapters go into the HF model in place (`peft.inject_adapter_in_model`, no PeftModel wrapper), so the forward
paths, the FSDP2 units and activation checkpointing see the same module tree; a targeted linear `X` becomes
`X.base_layer` (frozen) beside `X.lora_A.default` / `X.lora_B.default`. The optimizer takes only parameters that
require grad, so its state covers the adapters alone. What leaves the trainer (weight syncs, exports) is the merged
model under the HF names: W + (alpha / rank) * B @ A.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from agentrl.config.schema import LoraConfig
from agentrl.weightsync import adapters
from agentrl.weightsync.adapters import PEFT_PREFIX

BASE = ".base_layer."
ADAPTER = "default"
_A, _B = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"


def add_adapters(model: nn.Module, cfg: LoraConfig) -> None:
    """Inject the adapters (on whatever device the model is, the meta device included) and freeze the rest."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    spec = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                          target_modules=list(cfg.target_modules), bias="none")  # fmt: skip
    try:
        inject_adapter_in_model(spec, model, adapter_name=ADAPTER)
    except ValueError as err:  # peft's "Target modules {...} not found in the base model"
        raise ValueError(f"trainer.lora.target_modules {cfg.target_modules} matched no linear layer of the model "
                         f"({err})") from None  # fmt: skip
    model._agentrl_lora = True  # FSDP2 wraps the module in place: the mark stays


def has_adapters(model: nn.Module) -> bool:
    """Whether `add_adapters` went into `model` (a policy built with trainer.lora; its full warm start's is plain)."""
    return bool(getattr(model, "_agentrl_lora", False))


def peft_name(name: str) -> str:
    """An adapter's name as peft saves it: `base_model.model.<module>.lora_A.weight`."""
    return PEFT_PREFIX + name.replace(f".{ADAPTER}.", ".")


def adapter_config(cfg: LoraConfig, base: str | None = None) -> dict:
    return adapters.adapter_config(cfg.rank, cfg.alpha, list(cfg.target_modules), base)


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def hf_name(name: str) -> str:
    """A base weight's name as the HF checkpoint (and the engines) have it."""
    return name.replace(BASE, ".")


def initial_state(shapes: dict[str, tuple[int, ...]], checkpoint: dict[str, torch.Tensor], seed: int = 0):
    """The full state of a model with adapters, from the HF checkpoint (`checkpoint`, keyed by HF names): base
    weights from it, A as peft initialises it (Kaiming-uniform, a=sqrt(5)), B zero, so the model starts as the
    base model. Seeded: every run starts from the same adapters."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        if name.endswith(_A):
            bound = 1.0 / math.sqrt(shape[1])  # kaiming_uniform_(a=sqrt(5)) on a [rank, in] matrix
            out[name] = (torch.rand(shape, generator=g) * 2 - 1) * bound
        elif name.endswith(_B):
            out[name] = torch.zeros(shape)
        else:
            out[name] = checkpoint[hf_name(name)]
    return out


def hf_metas(
    named: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of the merged model: the adapters folded away, base weights under their HF names."""
    return [(hf_name(k), shape, dtype) for k, shape, dtype in named if not is_adapter(k)]


def merged(named: Iterable[tuple[str, torch.Tensor]], scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """The merged weights under HF names, in `hf_metas` order, from the full tensors of a model with adapters in
    state-dict order (a layer's base weight and bias, then its A, then its B): W + scaling * B @ A."""
    layers: dict[str, dict[str, torch.Tensor]] = {}  # layer prefix -> its base weight, bias, A until B arrives
    for name, t in named:
        if BASE in name:
            prefix, _, part = name.partition(BASE)
            layers.setdefault(prefix, {})[part] = t
        elif name.endswith(_A):
            layers[name.removesuffix(_A)]["A"] = t
        elif name.endswith(_B):
            prefix = name.removesuffix(_B)
            parts = layers.pop(prefix)
            base, a = parts.pop("weight"), parts.pop("A")
            yield f"{prefix}.weight", base + scaling * (t.to(base.dtype) @ a.to(base.dtype))
            yield from ((f"{prefix}.{part}", v) for part, v in parts.items())  # the bias, as HF orders it
        else:
            yield name, t
    if layers:
        raise RuntimeError(f"LoRA layers without both adapters: {sorted(layers)[:3]}")


def scaling(cfg: LoraConfig) -> float:
    return cfg.alpha / cfg.rank
