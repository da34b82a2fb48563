"""Many model turns per Ray call, each answered as soon as it is done: the engine side of `EngineClient`.

One Ray actor call costs ~1.5 ms of CPU (caller and actor together, measured on 2 cores): with one call per turn, a
128-episode Sokoban step (~1,400 turns) spent ~2 CPU-seconds on calls alone, about a seventh of the machine.
Batching whole calls would tie every turn of a batch to its slowest one (a 4k-token answer would hold 63 short
ones). So the two directions are batched separately: `submit` starts every request a client queued since its last
call, each as its own `generate` (gate, versions, preemption unchanged); `collect` returns whatever has finished
since the client's last collect, waiting only while nothing has. Under load each call carries many turns; a lone
turn costs two calls instead of one.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from functools import partial

from agentrl.config.schema import SamplingConfig
from agentrl.rollout.base import EngineDeadError, EngineError
from agentrl.types import GenOutput

TurnRequest = tuple[str, list[int], SamplingConfig]  # request id, prompt tokens, sampling
TurnResult = tuple[str, GenOutput | EngineError]  # request id, its output or why it failed


@dataclass
class _Box:
    """One client's requests on this engine: those running, and the results its next collect takes."""

    running: dict[str, asyncio.Task] = field(default_factory=dict)
    finished: list[TurnResult] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def done(self, request_id: str, task: asyncio.Task) -> None:
        self.running.pop(request_id, None)
        if task.cancelled():  # the client gave up on it (timeout, drained lease, cancelled episode)
            return
        err = task.exception()
        self.finished.append((request_id, task.result() if err is None else portable_error(err)))
        self.ready.set()


def portable_error(err: BaseException) -> EngineError:
    """The failure as one of our own picklable errors. A backend's death (vLLM's EngineDeadError, matched by name
    as the router does) stays a death, so the client reports it."""
    if isinstance(err, EngineError):
        return err
    lines = str(err).strip().splitlines()
    text = f"{type(err).__name__}: {lines[0] if lines else ''}"
    if any(c.__name__ == "EngineDeadError" for c in type(err).__mro__):
        return EngineDeadError(text)
    return EngineError(text)


class TurnMailbox:
    """Mixin for engine actors whose `generate(token_ids, sampling, request_id)` serves one request."""

    _boxes: dict[str, _Box]

    def _box(self, client: str) -> _Box:
        if not hasattr(self, "_boxes"):
            self._boxes = {}
        return self._boxes.setdefault(client, _Box())

    async def submit(self, client: str, requests: list[TurnRequest], cancel: list[str] | None = None) -> None:
        """Start every request at once, each result to wait in `client`'s box for `collect`; then stop those in
        `cancel` (the client no longer waits for them: an aborted vLLM request frees its KV cache)."""
        box = self._box(client)
        for request_id, token_ids, sampling in requests:
            task = asyncio.ensure_future(self.generate(token_ids, sampling, request_id))  # type: ignore[attr-defined]
            box.running[request_id] = task
            task.add_done_callback(partial(box.done, request_id))
        for request_id in cancel or ():  # after the starts: a turn queued and given up in one go ends here too
            task = box.running.pop(request_id, None)
            if task is not None:
                task.cancel()

    async def collect(self, client: str, wait_s: float) -> list[TurnResult]:
        """Every result finished since the last collect; waits up to `wait_s` while there is none."""
        box = self._box(client)
        if not box.finished:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(box.ready.wait(), wait_s)
        out, box.finished = box.finished, []
        box.ready.clear()
        return out
