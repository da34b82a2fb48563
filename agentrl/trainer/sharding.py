"""Building FSDP2-sharded models without a full copy per rank: meta-device skeleton, activation checkpointing,
mixed precision and CPU offload, then the checkpoint broadcast from rank 0 into the shards.

Order matters: checkpoint-wrap each decoder layer *before* `fully_shard`, so FSDP2's hooks sit outside the
recomputed region (its pre-backward hook all-gathers the layer, then the wrapper recomputes inside it; the
composition torchtitan uses). HF's `gradient_checkpointing_enable` instead recomputes *inside* the module's
`__call__`, around FSDP2's hooks, and silently drops the KV cache the shared-prefix pass needs.
"""

from __future__ import annotations

import glob
import os
from typing import Literal

import torch
from torch import nn

from agentrl.config.schema import TrainerConfig
from agentrl.platform import Platform
from agentrl.trainer import lora, varlen_attention
from agentrl.trainer.model import ValueModel, decoder_layers

Role = Literal["policy", "reference", "critic"]


def resolve_dtype(tc: TrainerConfig, platform: Platform) -> torch.dtype:
    """Compute dtype: `auto` is fp32 on CPU (bf16 matmuls are slow there), bf16 on accelerators."""
    if tc.precision == "auto":
        return platform.default_dtype()
    return torch.bfloat16 if tc.precision == "bf16" else torch.float32


def resolve_checkpointing(tc: TrainerConfig, platform: Platform) -> bool:
    """`None` = on for accelerators (activation memory is the limit there), off on CPU (recompute costs time)."""
    return platform.is_accelerator if tc.activation_checkpointing is None else tc.activation_checkpointing


def attn_implementation(platform: Platform, compute: torch.dtype) -> str:
    """The attention a model built here gets (`varlen_attention.choose_attention`: flash_attention_2 on Ascend NPU
    and on CUDA with flash-attn, torch's varlen kernel on CUDA without it, SDPA otherwise), registered with
    transformers when it is agentrl's own. Packed micro-batches then run as variable-length attention from their
    position ids (see `model_mask`), except under SDPA, which takes the dense block mask."""
    attn = varlen_attention.choose_attention(platform.kind, compute == torch.bfloat16)
    return varlen_attention.register() if attn == varlen_attention.VARLEN else attn


def _hf_config(path: str):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    cfg.use_cache = False
    return cfg


def skeleton(path: str, role: Role, dtype: torch.dtype, attn: str = "sdpa") -> nn.Module:
    """The model with every parameter and buffer on the meta device (no memory, no init work)."""
    from transformers import AutoModel, AutoModelForCausalLM

    cfg = _hf_config(path)
    with torch.device("meta"):
        if role == "critic":
            return ValueModel(AutoModel.from_config(cfg, dtype=dtype, attn_implementation=attn))
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)


def checkpoint_layers(model: nn.Module) -> None:
    """Wrap each decoder layer in non-reentrant activation checkpointing (only the layer input is kept).

    The wrapper's state-dict hooks strip its `_checkpoint_wrapped_module.` prefix, so names stay HF's.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    for layer in decoder_layers(model):
        parent, name = _parent_of(model, layer)
        setattr(parent, name, checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT))
    model.recomputes_layers = True  # causal_logits: no KV-cache prefix sharing while grads flow


def _parent_of(root: nn.Module, child: nn.Module) -> tuple[nn.Module, str]:
    for mod in root.modules():
        for name, c in mod.named_children():
            if c is child:
                return mod, name
    raise ValueError("module is not part of the model")


def shard(model: nn.Module, mp_dtype: torch.dtype | None, offload: bool, pin_memory: bool = True) -> nn.Module:
    """fully_shard every decoder layer, then the root. `mp_dtype`: compute (and all-gather) dtype over fp32
    master weights, gradients reduced in fp32; `offload`: sharded params, grads and optimizer state on host
    (pinned for async copies when there is an accelerator; pinning needs one)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=mp_dtype, reduce_dtype=torch.float32) if mp_dtype is not None else None
    kw = {
        "mp_policy": mp or MixedPrecisionPolicy(),
        "offload_policy": CPUOffloadPolicy(pin_memory=pin_memory) if offload else OffloadPolicy(),
    }
    for layer in decoder_layers(model):
        fully_shard(_wrapper_of(model, layer), **kw)
    fully_shard(model, **kw)
    return model


def _wrapper_of(model: nn.Module, layer: nn.Module) -> nn.Module:
    """The checkpoint wrapper around `layer` if there is one: the FSDP2 unit must contain the recompute."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    parent, _ = _parent_of(model, layer)
    return parent if isinstance(parent, CheckpointWrapper) else layer


def init_buffers(model: nn.Module) -> None:
    """Recompute the non-persistent buffers (rotary `inv_freq`), which are not in the checkpoint and hold
    garbage after `to_empty`. HF's own `_init_weights` knows how (it is what transformers 5 runs after its own
    meta-device loading); the parameters it also touches are overwritten by the checkpoint afterwards."""
    hf = _hf_of(model)
    for m in model.modules():
        if m._non_persistent_buffers_set:
            hf._init_weights(m)


def read_checkpoint(path: str, keys: list[str], tied: bool) -> dict[str, torch.Tensor]:
    """The HF safetensors of `path` restricted to `keys` (the model's state-dict names), on CPU.

    A tied LM head takes the embedding; a critic's value head (absent from the LM checkpoint) starts at 0.
    """
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors under {path}")
    full: dict[str, torch.Tensor] = {}
    for f in files:
        full.update(load_file(f))
    out = {}
    for k in keys:
        if k in full:
            out[k] = full[k]
        elif k == "lm_head.weight" and tied:
            out[k] = full["model.embed_tokens.weight"]
        elif k.startswith("value_head."):
            continue  # filled below from the embedding's hidden size
        else:
            raise KeyError(f"{k} missing from the checkpoint at {path}")
    if "value_head.weight" in keys:
        out["value_head.weight"] = torch.zeros(1, full["model.embed_tokens.weight"].shape[1])
        out["value_head.bias"] = torch.zeros(1)
    return out


def build_sharded(path: str, device: torch.device, tc: TrainerConfig, platform: Platform, role: Role) -> nn.Module:
    """A policy, reference or critic, FSDP2-sharded, its shards filled from the HF checkpoint at `path`.

    Collective (every rank of the default process group calls it). Only rank 0 reads the checkpoint; it is
    broadcast tensor by tensor and each rank keeps its shard, so no rank ever holds a full fp32 copy besides
    rank 0's host copy of the file. Policy and critic keep fp32 master weights (and optimizer state); under
    bf16 they compute in bf16 with fp32 gradient reduction. The reference is stored in the compute dtype,
    without grads, in eval mode.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    compute = resolve_dtype(tc, platform)
    train = role != "reference"
    model = skeleton(path, role, torch.float32 if train else compute, attn_implementation(platform, compute))
    adapters = role == "policy" and tc.lora is not None
    if adapters:  # before the FSDP2 units are cut: each layer's adapters shard with it
        lora.add_adapters(model, tc.lora)
    if train and resolve_checkpointing(tc, platform):
        checkpoint_layers(model)
    shard(model, compute if train and compute != torch.float32 else None, tc.cpu_offload, platform.is_accelerator)
    model.to_empty(device=torch.device("cpu") if tc.cpu_offload else device)
    with torch.no_grad():
        init_buffers(model)
    # A tied LM head is the embedding's Parameter from construction on; FSDP2 shards it once, to_empty keeps it.
    tied = bool(getattr(_hf_of(model).config, "tie_word_embeddings", False))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    sd = {}
    if dist.get_rank() == 0 and adapters:
        base = read_checkpoint(path, sorted({lora.hf_name(k) for k in shapes if not lora.is_adapter(k)}), tied)
        sd = lora.initial_state(shapes, base)
    elif dist.get_rank() == 0:
        sd = read_checkpoint(path, list(shapes), tied)
    set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    if not train:
        model.eval().requires_grad_(False)
    return model


def _hf_of(model: nn.Module) -> nn.Module:
    """The outermost HF PreTrainedModel inside `model` (the model itself, or a critic's backbone)."""
    from transformers import PreTrainedModel

    return next(m for m in model.modules() if isinstance(m, PreTrainedModel))
