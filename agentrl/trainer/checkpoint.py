"""Checkpoint files every backend shares, and Hugging Face exports of FSDP2 checkpoints.

A trainer checkpoint directory holds the backend's shards of models and optimizers (FSDP2: torch.distributed
.checkpoint; Megatron: its distributed checkpoint), `extra_rank{R}.pt` per rank (schedules, CPU and device RNG
state, policy version, optimizer steps), `meta.json` (version, optimizer steps, world size, backend, optimizer
names; written last) and `hf/` (config + tokenizer files) so that `agentrl export CKPT OUT` can rebuild a plain HF
model dir without the original model path.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "agentrl_tiny.json",
)


def copy_hf_side_files(src: str | Path, dst: str | Path) -> None:
    """Config and tokenizer files (everything but the weights) from one HF dir to another."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for name in HF_SIDE_FILES:
        if (Path(src) / name).exists():
            shutil.copy2(Path(src) / name, dst / name)


def write_safetensors(state: dict[str, torch.Tensor], out_dir: str | Path, name: str = "model.safetensors") -> str:
    """Write atomically (temp file + rename) so an engine never reads half a snapshot."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{name}.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / name)
    return str(out)


def rng_state(device_module: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's RNG: the CPU generator, and its device's (dropout and sampling on an accelerator draw from it).
    `device_module` is torch.cuda / torch.npu (`Platform.device_module()`), None on CPU."""
    state = {"cpu": torch.get_rng_state()}
    if device_module is not None:
        state[device.type] = device_module.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor] | torch.Tensor, device_module: Any, device: torch.device) -> None:
    """Inverse of `rng_state`. A bare tensor is an older checkpoint's CPU state; a device state saved on another
    device type is left out (generator states do not carry over between CUDA and NPU)."""
    if isinstance(state, torch.Tensor):
        state = {"cpu": state}
    torch.set_rng_state(state["cpu"])
    if device_module is not None and device.type in state:
        device_module.set_rng_state(state[device.type], device)


def export_hf(ckpt_dir: str | Path, out_dir: str | Path, merged: bool = True) -> str:
    """Rebuild a transformers-loadable model dir from a trainer checkpoint of either backend, in one process
    (no process group, no GPU). A LoRA checkpoint's adapters are merged into the weights, unless `merged` is
    False: then `out_dir` is a peft adapter dir and `out_dir/base` the HF model dir of the base it was trained on
    (the warm start's, when it fine-tuned every weight)."""
    ckpt = Path(ckpt_dir)
    hf = ckpt / "hf"
    if not (ckpt / "meta.json").exists() or not (hf / "config.json").exists():
        raise FileNotFoundError(f"{ckpt} is not an agentrl checkpoint (needs meta.json and hf/config.json)")
    meta = json.loads((ckpt / "meta.json").read_text())
    if meta.get("backend", "fsdp2") == "megatron":
        from agentrl.trainer.backends.megatron_bridge import export_hf as export_megatron

        export_megatron(str(ckpt), str(out_dir), hf_path=str(hf))
        return str(out_dir)
    return _export_dcp(ckpt, Path(out_dir), meta.get("lora"), merged, meta.get("lora_base"))


def _export_dcp(
    ckpt: Path, out_dir: Path, adapters: dict | None = None, merged: bool = True, base_dir: str | None = None
) -> str:
    """The FSDP2 backend's checkpoint (DCP shards, the policy under 'model') as an HF model dir; a LoRA run's
    (`adapters`: its trainer.lora) merged, or as an adapter dir beside its base (`export_hf`). A LoRA checkpoint
    holds the adapters alone: the base comes from `base_dir`, the HF model dir the run's base was built from."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    from agentrl.config.schema import LoraConfig
    from agentrl.trainer import lora
    from agentrl.weightsync.adapters import write_adapter

    hf = ckpt / "hf"
    config = AutoConfig.from_pretrained(hf)
    # Built on CPU, not on the meta device: rotary inv_freq buffers are not in the state dict.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    cfg = LoraConfig(**adapters) if adapters is not None else None
    if cfg is not None:  # the checkpoint's names are those of the model with adapters
        lora.add_adapters(model, cfg)
    weights = model.state_dict()
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    state = {"model": {k: v for k, v in weights.items() if base_dir is None or lora.is_adapter(k)}}
    dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    if base_dir is not None:  # the frozen base from the dir it came from
        if not (Path(base_dir) / "config.json").exists():
            raise FileNotFoundError(f"{ckpt} holds LoRA adapters whose base {base_dir} is gone (a full warm "
                                    "start's weights): restore it to export")  # fmt: skip
        from agentrl.trainer.sharding import read_checkpoint

        names = [k for k in weights if not lora.is_adapter(k)]
        base = read_checkpoint(base_dir, sorted({lora.hf_name(k) for k in names}), config.tie_word_embeddings)
        state["model"] = {k: state["model"][k] if lora.is_adapter(k) else base[lora.hf_name(k)] for k in weights}
    weights = state["model"]
    if cfg is not None and not merged:
        write_adapter(out_dir, {lora.peft_name(k): v for k, v in weights.items() if lora.is_adapter(k)},
                      lora.adapter_config(cfg, "base"))  # fmt: skip
        out_dir, weights = out_dir / "base", {lora.hf_name(k): v for k, v in weights.items() if not lora.is_adapter(k)}
    elif cfg is not None:
        weights = dict(lora.merged(weights.items(), lora.scaling(cfg)))
    write_safetensors({k: v.contiguous() for k, v in weights.items()}, out_dir)
    copy_hf_side_files(hf, out_dir)
    return str(out_dir.parent if cfg is not None and not merged else out_dir)
