"""The LoRA adapter format engines load (trainer.lora with sync: adapter): a peft adapter dir, adapter_config.json
beside adapter_model.safetensors whose tensors are named `base_model.model.<module>.lora_A.weight` (as peft saves
them and vLLM's add_lora reads them). The trainer writes one for a disk sync and an export; an engine worker
writes one from the adapter tensors of a collective sync."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the router's process loads this module (with agentrl.rollout.vllm_engine): no torch there
    import torch

PEFT_PREFIX = "base_model.model."
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def is_adapter_tensor(name: str) -> bool:
    return name.startswith(PEFT_PREFIX)


def adapter_config(rank: int, alpha: float, target_modules: list[str], base: str | None = None) -> dict:
    """adapter_config.json as peft writes it for a plain LoRA; `base` (peft's base_model_name_or_path): the HF
    model dir of the base the adapter was trained on, None for the model the engines started from."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
        "target_modules": sorted(target_modules), "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "use_dora": False, "modules_to_save": None, "base_model_name_or_path": base,
    }  # fmt: skip


def write_adapter(out_dir: str | Path, tensors: dict[str, torch.Tensor], config: dict) -> str:
    """An adapter dir; the weights land atomically (temp file + rename), the config after them."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{WEIGHTS}.tmp"
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp), {"format": "pt"})
    os.replace(tmp, out / WEIGHTS)
    (out / CONFIG).write_text(json.dumps(config, indent=1))
    return str(out)


def base_of(adapter_dir: str) -> str | None:
    """The base dir an adapter dir names; None when `adapter_dir` is no adapter dir."""
    path = os.path.join(adapter_dir, CONFIG)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f).get("base_model_name_or_path") or ""
