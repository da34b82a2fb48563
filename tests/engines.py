"""Helpers for tests against the real vLLM engine fleet: how many tokens are streaming, and new weights to update to."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any


async def tokens_streaming(engines: list[Any]) -> int:
    """Tokens the engines are generating right now (a request is under way when this is above 0)."""
    return sum(s["tokens_streaming"] for s in await asyncio.gather(*(e.stats.remote() for e in engines)))


def nudged_weights(model_path: str, out: Path) -> str:
    """A copy of the model at `out` with every weight moved by 0.001: new weights an update can load."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_path, out)
    weights = load_file(f"{out}/model.safetensors")
    save_file({k: v + 0.001 * torch.ones_like(v) for k, v in weights.items()}, f"{out}/model.safetensors")
    return str(out)
