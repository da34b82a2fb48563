"""Whole-run checkpoints: trainer state + one snapshot of where every admitted task group stands.

Each admitted group is, at any instant, running, finished and waiting in the buffer, or trained. The snapshot
is taken at one instant on the driver's event loop (no `await` inside, so neither the producer nor a finishing
group can move in the middle of it): the schedule cursor, the groups to re-run (running, or admitted-to-re-run
and not started yet), the finished groups still queued and the groups trained so far. A resumed run re-runs the
running groups, replays the queued ones and continues the schedule: every admitted group is trained exactly once.

A checkpoint directory is written under a temporary name and renamed into place, and `latest` names it only
after that, so a kill at any point leaves the previous checkpoint intact and the next resume consistent.
"""

from __future__ import annotations

import copy
import json
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

    def at(self, position: int) -> tuple[str, int]:
        """The task group at a position of the schedule."""
        rnd, pos = divmod(position, len(self.tags))
        tag = self.tags[pos]
        return tag, self.seed_start[tag] + rnd * self.per_round[tag] + self.tags[:pos].count(tag)


@dataclass
class RunState:
    schedule: TaskSchedule
    step: int = 0
    first_val: dict[str, float] = field(default_factory=dict)
    to_rerun: list[tuple[str, int]] = field(default_factory=list)  # admitted before a stop, not yet started again
    trained: int = 0  # task groups trained so far

    def peek_task(self) -> tuple[str, int]:
        """The next group to start: groups to re-run first, then the schedule."""
        return self.to_rerun[0] if self.to_rerun else self.schedule.at(self.schedule.cursor)

    def take_task(self) -> tuple[str, int]:
        """Consume the group peek_task() named (right after the buffer admitted it, with no await between)."""
        if self.to_rerun:
            return self.to_rerun.pop(0)
        task = self.schedule.at(self.schedule.cursor)
        self.schedule.cursor += 1
        return task


@dataclass
class Snapshot:
    """Everything but the trainer, at one instant; `describe()` is the line printed on resume."""

    state: RunState
    buffer: dict[str, Any]

    @classmethod
    def take(cls, state: RunState, buffer: Any) -> Snapshot:
        """Synchronous on purpose: called on the event loop, it sees one instant."""
        return cls(copy.deepcopy(state), buffer.state())

    def describe(self) -> str:
        """After load_run_state, where to_rerun holds every group that was in flight."""
        running, ready = len(self.state.to_rerun), len(self.buffer["ready"])
        return f"resuming from step {self.state.step} ({running} groups in flight, {ready} ready)"


@dataclass
class TrainedLog:
    """Which task groups each step trained, one JSON line per step: the audit trail of exactly-once training."""

    path: Path

    def record(self, step: int, groups: list[Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "groups": [f"{g.tag}/{g.seed}" for g in groups]}) + "\n")

    def forget_after(self, step: int) -> None:
        """On resume (or a restart from scratch, step 0): the steps after the checkpoint are trained again."""
        if self.path.exists():
            lines = self.path.read_text().splitlines()
            kept = [line for line in lines if json.loads(line)["step"] <= step]
            self.path.write_text("".join(f"{line}\n" for line in kept))


def latest_checkpoint(run_dir: Path) -> Path | None:
    marker = run_dir / "checkpoints" / "latest"
    if not marker.exists():
        return None
    path = run_dir / "checkpoints" / marker.read_text().strip()
    return path if (path / "pipeline.pkl").exists() else None


def save_run_state(run_dir: Path, snapshot: Snapshot, trainer: Any, keep_last: int) -> Path:
    """Write trainer + snapshot as checkpoints/step-N. When `latest` already names a step-N (saved again at the
    end of a run, or on a stop), that one is kept: it is just as consistent, and replacing it would open a window
    with no checkpoint at all. Any other step-N was left by a killed run and is replaced."""
    root = run_dir / "checkpoints"
    path = root / f"step-{snapshot.state.step:06d}"
    if latest_checkpoint(run_dir) != path:
        tmp = root / f".{path.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        trainer.save_checkpoint(str(tmp / "trainer"))
        (tmp / "pipeline.pkl").write_bytes(pickle.dumps(snapshot))
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    (root / "latest.tmp").write_text(path.name)
    os.replace(root / "latest.tmp", root / "latest")
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def load_run_state(path: Path, trainer: Any, buffer: Any) -> Snapshot:
    """Restore trainer and buffer; the returned snapshot's state re-runs every group that was running."""
    trainer.load_checkpoint(str(path / "trainer"))
    snapshot: Snapshot = pickle.loads((path / "pipeline.pkl").read_bytes())
    running = buffer.load_state(snapshot.buffer)
    snapshot.state.to_rerun = [*running, *snapshot.state.to_rerun]
    return snapshot
