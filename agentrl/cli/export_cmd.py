"""`agentrl export CKPT OUT`: turn a sharded trainer checkpoint into a Hugging Face model directory."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from agentrl.cli import UsageError


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("export", parents=[common], help="write a HF model dir (transformers, vLLM) from a checkpoint")
    p.add_argument("checkpoint", help="checkpoint directory written by the trainer (save_checkpoint)")
    p.add_argument("out_dir", help="output directory (config, tokenizer, model.safetensors)")
    p.set_defaults(func=_export)


def _export(args: argparse.Namespace) -> int:
    from agentrl.trainer.checkpoint import export_hf

    ckpt = Path(args.checkpoint)
    if not (ckpt / ".metadata").exists() or not (ckpt / "hf" / "config.json").exists():
        raise UsageError(f"{ckpt} is not an agentrl trainer checkpoint (no .metadata or hf/config.json)")
    start = time.perf_counter()
    out = export_hf(ckpt, args.out_dir)
    print(f"exported {ckpt} -> {out} ({time.perf_counter() - start:.1f}s)")
    return 0
