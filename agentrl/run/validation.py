"""When validation runs, stated once, and the one validation under way.

Held-out episodes run at step 0 and every `validation.every_steps` steps (when there are val envs), on the
engines beside the next train step: the trainer's core would idle while the engines validate. The engines keep
the weights a validation measures until it ends (the next step syncs its weights only after it), and a run that
ends between due steps validates its last step too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from agentrl.config import Config


class Validation:
    def __init__(self, cfg: Config, run: Callable[[int], Awaitable[dict[str, float]]]) -> None:
        self.every = cfg.validation.every_steps if cfg.envs.val else 0
        self._run = run  # held-out episodes on the engines' current weights, logged at the step given
        self.task: asyncio.Task | None = None  # the one under way
        self.last: dict[str, float] = {}  # the latest finished one's metrics

    @property
    def enabled(self) -> bool:
        return bool(self.every)

    def due(self, step: int) -> bool:
        """Whether the weights of `step` get validated."""
        return self.enabled and step % self.every == 0

    def start(self, step: int) -> None:
        """Start validating `step` beside whatever comes next, if it is due."""
        if self.due(step):
            self.task = asyncio.ensure_future(self._run(step))

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    async def done(self) -> None:
        """Wait for the one under way (its failure raises here)."""
        task, self.task = self.task, None
        if task is not None:
            self.last = await task

    def drop(self) -> None:
        """A stop or a stall cuts the one under way short; a resume from that step runs it again."""
        if self.task is not None:
            self.task.cancel()
            self.task = None

    async def finish(self, step: int) -> None:
        """At the end of the run: wait for the one under way, and validate the last step if it was not due."""
        await self.done()
        if self.enabled and not self.due(step):
            self.last = await self._run(step)
