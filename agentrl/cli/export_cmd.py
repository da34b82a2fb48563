"""`agentrl export CKPT OUT`: turn a sharded trainer checkpoint into a Hugging Face model directory (a LoRA run's:
its adapter dir and the base it goes with, or with --merged one merged model)."""

from __future__ import annotations

import argparse
import time

from agentrl.cli import UsageError


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("export", parents=[common], help="write a HF model dir (transformers, vLLM) from a checkpoint")
    p.add_argument(
        "checkpoint", help="a run dir (its latest checkpoint), a step dir (checkpoints/step-N) or its trainer/ folder"
    )
    p.add_argument("out_dir", help="output directory (config, tokenizer, model.safetensors)")
    p.add_argument(
        "--merged",
        action="store_true",
        help="a LoRA checkpoint (trainer.lora): write the adapters merged into the weights (one HF model dir) "
        "instead of the adapter dir (peft format) with its base in OUT_DIR/base",
    )
    p.set_defaults(func=_export)


def _export(args: argparse.Namespace) -> int:
    from agentrl.run.checkpoint_paths import CheckpointPathError, resolve_model_source
    from agentrl.trainer.checkpoint import export_hf

    try:
        source = resolve_model_source(args.checkpoint)
    except CheckpointPathError as err:
        raise UsageError(str(err)) from None
    if source.kind == "hf":
        raise UsageError(f"{source.path} is already a Hugging Face model dir: nothing to export (use it as it is)")
    start = time.perf_counter()
    out = export_hf(source.path, args.out_dir, merged=args.merged)
    print(f"exported {source.path} -> {out} ({time.perf_counter() - start:.1f}s)")
    return 0
