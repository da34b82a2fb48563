"""The trainer: FSDP2 ranks as Ray actors, policy-gradient losses with off-policy correction, weight export,
checkpoints and SFT. Pure pieces (advantages, losses, batching) import without Ray or a process group."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentrl.trainer.group import TrainerGroup

__all__ = ["TrainerGroup"]


def __getattr__(name: str):
    if name == "TrainerGroup":  # lazy: keeps `import agentrl.trainer.losses` free of Ray
        from agentrl.trainer.group import TrainerGroup

        return TrainerGroup
    raise AttributeError(name)
