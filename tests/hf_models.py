"""A whole HF model in one process, for tests that compare the trainer's passes with the plain model (the trainer
itself builds its models sharded: agentrl.trainer.sharding)."""

from __future__ import annotations

import torch
from torch import nn


def load_causal_lm(path: str, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """An HF causal LM with SDPA attention (it takes the 4D block-diagonal masks of packed micro-batches)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    return model.to(device)


def load_value_model(path: str, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The critic (agentrl.trainer.model.ValueModel) loaded whole: every rank would read the whole checkpoint."""
    from transformers import AutoModel

    from agentrl.trainer.model import ValueModel

    return ValueModel(AutoModel.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")).to(device)
