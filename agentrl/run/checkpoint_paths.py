"""What a path given to `agentrl export` / `agentrl eval --checkpoint` names: a trainer checkpoint or a HF model dir.

Accepted forms, tried in this order:
- a trainer checkpoint dir (`meta.json` + `hf/config.json`, as `save_checkpoint` writes them), e.g. `.../trainer`;
- a step dir `checkpoints/step-N` (its `trainer/` subfolder);
- a Hugging Face model dir (`config.json` and weights);
- a run dir (its latest checkpoint, `checkpoints/latest`), or that run's `checkpoints/` folder.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from agentrl.run.state import latest_checkpoint

FORMS = "a run dir, a step dir (checkpoints/step-N or its trainer/) or a Hugging Face model dir"


class CheckpointPathError(ValueError):
    """The path is none of the accepted forms (one line)."""


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["trainer", "hf"]
    path: Path  # the trainer checkpoint dir itself, or the HF model dir


def is_trainer_checkpoint(path: Path) -> bool:
    return (path / "meta.json").is_file() and (path / "hf" / "config.json").is_file()


def is_hf_model_dir(path: Path) -> bool:
    weights = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin")
    return (path / "config.json").is_file() and any(next(path.glob(g), None) for g in weights)


def resolve_model_source(path: str | Path) -> ModelSource:
    """Trainer checkpoint (a run's latest, a step's, or one named directly) or HF model dir; else one line."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointPathError(f"{p} is not a directory; expected {FORMS}")
    for candidate in (p, p / "trainer"):
        if is_trainer_checkpoint(candidate):
            return ModelSource("trainer", candidate)
    if is_hf_model_dir(p):
        return ModelSource("hf", p)
    run_dir = p.parent if p.name == "checkpoints" and (p / "latest").exists() else p
    if (run_dir / "checkpoints").is_dir():
        step = latest_checkpoint(run_dir)
        if step is not None and is_trainer_checkpoint(step / "trainer"):
            return ModelSource("trainer", step / "trainer")
        raise CheckpointPathError(f"run dir {run_dir} has no complete checkpoint yet (checkpoints/latest)")
    raise CheckpointPathError(f"{p} is not an agentrl trainer checkpoint or a model dir: expected {FORMS}")


def hf_dir_for_eval(source: ModelSource) -> Path:
    """A HF model dir for engines to load: the dir itself, or the trainer checkpoint exported next to it
    (`<ckpt>-hf`, on the run's storage, which every node sees; reused while newer than the checkpoint)."""
    if source.kind == "hf":
        return source.path
    from agentrl.trainer.checkpoint import export_hf

    out = source.path.with_name(f"{source.path.name}-hf")
    if is_hf_model_dir(out) and out.stat().st_mtime >= (source.path / "meta.json").stat().st_mtime:
        return out
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    export_hf(source.path, tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out
