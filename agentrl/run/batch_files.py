"""RL batches as files: what the trainer took at each step, written with `logging.save_batches` and read back by
tests and by anyone debugging a run (token ids, loss masks, behaviour log-probs, versions, rewards, groups).

One gzip'd JSON line per sample, in batch order: a file holds exactly the `Sample`s `train_step` received, so a
step can be replayed through the trainer outside the run (the exactness tests do this on recorded batches of the
shipped examples).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from collections.abc import Iterable
from pathlib import Path

from agentrl.types import Sample


def batch_path(batches_dir: Path, step: int) -> Path:
    """The file of the batch trained at RL step `step` (1-based, as logged)."""
    return batches_dir / f"step-{step:06d}.jsonl.gz"


def save_batch(path: Path, samples: Iterable[Sample]) -> Path:
    """Write `samples` to `path` (through a temporary file: a reader never sees half a batch)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps(dataclasses.asdict(s), separators=(",", ":")) + "\n")
    tmp.replace(path)
    return path


def load_batch(path: Path | str) -> list[Sample]:
    """The samples `save_batch` wrote, in order; a line that is not a sample is an error naming the file and line."""
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                out.append(Sample(**json.loads(line)))
            except (TypeError, ValueError) as err:
                raise ValueError(f"{path}:{n}: not a saved sample ({err})") from err
    return out
