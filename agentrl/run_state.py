"""Whole-run checkpoints: trainer state + data position + buffered groups + groups that were in flight.

A resumed run re-runs the groups that were in flight (their seeds are saved), replays the queued finished groups,
and continues the task schedule where it stopped: no trajectory is lost or trained twice.
"""

from __future__ import annotations

import os
import pickle
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.config.schema import TrainEnvConfig


@dataclass
class TaskSchedule:
    """The deterministic order of training groups: tags interleaved by groups_per_batch, seeds counting up."""

    tags: list[str]
    seed_start: dict[str, int]
    per_round: dict[str, int]
    cursor: int = 0

    @classmethod
    def for_envs(cls, train: dict[str, TrainEnvConfig]) -> TaskSchedule:
        order = [tag for tag, spec in train.items() for _ in range(spec.groups_per_batch)]
        return cls(
            order, {t: s.seed_start for t, s in train.items()}, {t: s.groups_per_batch for t, s in train.items()}
        )

    def next(self) -> tuple[str, int]:
        rnd, pos = divmod(self.cursor, len(self.tags))
        self.cursor += 1
        tag = self.tags[pos]
        return tag, self.seed_start[tag] + rnd * self.per_round[tag] + self.tags[:pos].count(tag)


@dataclass
class RunState:
    schedule: TaskSchedule
    step: int = 0
    group_key: int = 0
    first_val: dict[str, float] = field(default_factory=dict)
    resumed: list[tuple[str, int]] = field(default_factory=list)

    def next_group_key(self) -> int:
        self.group_key += 1
        return self.group_key

    def take_resumed(self) -> list[tuple[str, int]]:
        out, self.resumed = self.resumed, []
        return out


def latest_checkpoint(run_dir: Path) -> Path | None:
    marker = run_dir / "checkpoints" / "latest"
    if not marker.exists():
        return None
    path = run_dir / "checkpoints" / marker.read_text().strip()
    return path if (path / "pipeline.pkl").exists() else None


def save_run_state(
    run_dir: Path, state: RunState, trainer: Any, buffer: Any, in_flight: list[tuple[str, int]], keep_last: int
) -> Path:
    root = run_dir / "checkpoints"
    path = root / f"step-{state.step:06d}"
    trainer.save_checkpoint(str(path / "trainer"))
    snapshot = RunState(state.schedule, state.step, state.group_key, state.first_val, [*state.resumed, *in_flight])
    tmp = path / "pipeline.pkl.tmp"
    tmp.write_bytes(pickle.dumps({"state": snapshot, "buffer": buffer.state()}))
    os.replace(tmp, path / "pipeline.pkl")
    (root / "latest.tmp").write_text(path.name)
    os.replace(root / "latest.tmp", root / "latest")
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def load_run_state(path: Path, trainer: Any, buffer: Any) -> RunState:
    trainer.load_checkpoint(str(path / "trainer"))
    data = pickle.loads((path / "pipeline.pkl").read_bytes())
    buffer.load_state(data["buffer"])
    return data["state"]
