"""Router over N engine actors: sticky episodes, least-loaded placement, health checks, fail-fast on death.

An episode id sticks to one engine so its growing prompt reuses that engine's prefix cache. New episodes go to
the live engine with the fewest requests (then tokens) in flight. An engine that dies or fails health checks is
drained: its pending requests fail at once with RetryableEngineError (never hang) and nothing new goes to it. When
it answers health checks again it rejoins, first loading the latest weights the router has seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from agentrl.config.schema import SamplingConfig
from agentrl.rollout.base import DrainMode, EngineError, RetryableEngineError
from agentrl.types import GenOutput

log = logging.getLogger(__name__)


@dataclass
class _Slot:
    index: int
    handle: Any
    alive: bool = True
    in_flight: int = 0
    tokens_in_flight: int = 0
    pending: set[asyncio.Future] = field(default_factory=set)
    failures: int = 0


def _is_actor_death(err: BaseException) -> bool:
    import ray.exceptions as rex

    return isinstance(err, rex.RayActorError | rex.ActorUnavailableError | rex.ActorDiedError)


class Router:
    def __init__(
        self,
        engines: list[Any],
        *,
        health_interval_s: float = 2.0,
        health_timeout_s: float = 10.0,
        request_timeout_s: float = 300.0,
    ):
        if not engines:
            raise ValueError("the router needs at least one engine")
        self._slots = [_Slot(i, h) for i, h in enumerate(engines)]
        self._sticky: dict[str, int] = {}
        self._health_interval_s = health_interval_s
        self._health_timeout_s = health_timeout_s
        self._request_timeout_s = request_timeout_s
        self._health_task: asyncio.Task | None = None
        self._weights: tuple[str, int] | None = None

    # ---- placement -------------------------------------------------------------------------------------------
    def _pick(self, episode_id: str) -> _Slot:
        index = self._sticky.get(episode_id)
        if index is not None and self._slots[index].alive:
            return self._slots[index]
        live = [s for s in self._slots if s.alive]
        if not live:
            raise RetryableEngineError("no live rollout engine")
        slot = min(live, key=lambda s: (s.in_flight, s.tokens_in_flight, s.index))
        self._sticky[episode_id] = slot.index
        return slot

    def release(self, episode_id: str) -> None:
        """Forget an episode's engine once it is finished."""
        self._sticky.pop(episode_id, None)

    # ---- requests --------------------------------------------------------------------------------------------
    async def generate(
        self, episode_id: str, token_ids: list[int], sampling: SamplingConfig, request_id: str
    ) -> GenOutput:
        self._ensure_health_loop()
        slot = self._pick(episode_id)
        cost = len(token_ids) + sampling.max_tokens
        slot.in_flight += 1
        slot.tokens_in_flight += cost
        fut = asyncio.ensure_future(self._call(slot, "generate", token_ids, sampling, request_id))
        slot.pending.add(fut)
        try:
            out = await asyncio.wait_for(fut, self._request_timeout_s)
            out.engine = slot.index
            return out
        except asyncio.CancelledError:
            if not slot.alive:
                raise RetryableEngineError(f"engine {slot.index} was drained") from None
            raise
        except TimeoutError:
            raise RetryableEngineError(f"engine {slot.index}: request {request_id} timed out") from None
        finally:
            slot.pending.discard(fut)
            slot.in_flight -= 1
            slot.tokens_in_flight -= cost

    async def _call(self, slot: _Slot, method: str, *args: Any) -> Any:
        try:
            return await getattr(slot.handle, method).remote(*args)
        except Exception as err:
            if _is_actor_death(err):
                self._drain(slot, f"died: {type(err).__name__}")
                raise RetryableEngineError(f"engine {slot.index} died") from err
            if isinstance(err, EngineError):
                raise
            cause = getattr(err, "cause", None)
            if isinstance(cause, EngineError):
                raise cause from err
            raise EngineError(f"engine {slot.index}: {err}") from err

    def _drain(self, slot: _Slot, why: str) -> None:
        if slot.alive:
            log.warning("rollout engine %d drained (%s)", slot.index, why)
        slot.alive = False
        for fut in list(slot.pending):
            fut.cancel()
        for episode, index in list(self._sticky.items()):
            if index == slot.index:
                del self._sticky[episode]

    # ---- health ----------------------------------------------------------------------------------------------
    def _ensure_health_loop(self) -> None:
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.ensure_future(self._health_loop())

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._check(slot) for slot in self._slots))
            await asyncio.sleep(self._health_interval_s)

    async def _check(self, slot: _Slot) -> None:
        try:
            status = await asyncio.wait_for(slot.handle.health.remote(), self._health_timeout_s)
            ok = bool(status.get("ok", False))
        except Exception:
            ok = False
        if not ok:
            self._drain(slot, "failed health check")
            return
        if not slot.alive:
            await self._rejoin(slot)

    async def _rejoin(self, slot: _Slot) -> None:
        try:
            if self._weights is not None:
                source, version = self._weights
                await slot.handle.update_weights.remote(source, version, "abort")
            slot.alive = True
            log.warning("rollout engine %d rejoined", slot.index)
        except Exception as err:
            log.warning("rollout engine %d could not rejoin: %s", slot.index, err)

    async def check_health(self) -> list[bool]:
        """Run one health round now (tests and the pipeline call it after replacing an engine)."""
        await asyncio.gather(*(self._check(slot) for slot in self._slots))
        return [s.alive for s in self._slots]

    def replace_engine(self, index: int, handle: Any) -> None:
        """Swap in a restarted engine; it rejoins at the next health round with the latest weights."""
        self._drain(self._slots[index], "replaced")
        self._slots[index] = _Slot(index, handle, alive=False)

    # ---- fleet-wide control ----------------------------------------------------------------------------------
    async def _each_live(self, method: str, *args: Any) -> list[Any]:
        live = [s for s in self._slots if s.alive]
        results = await asyncio.gather(*(self._call(s, method, *args) for s in live), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, RetryableEngineError)]
        if errors:
            raise errors[0]
        return [r for r in results if not isinstance(r, BaseException)]

    async def update_weights(self, source: str, version: int, drain: DrainMode = "abort") -> float:
        """Update every live engine; returns the slowest engine's seconds."""
        self._weights = (source, version)
        t0 = time.perf_counter()
        await self._each_live("update_weights", source, version, drain)
        return time.perf_counter() - t0

    async def pause(self) -> None:
        await self._each_live("pause")

    async def resume(self) -> None:
        await self._each_live("resume")

    async def stats(self) -> list[dict[str, Any]]:
        out = []
        for slot in self._slots:
            entry: dict[str, Any] = {
                "engine": slot.index,
                "alive": slot.alive,
                "router_in_flight": slot.in_flight,
            }
            if slot.alive:
                with contextlib.suppress(Exception):
                    entry.update(await asyncio.wait_for(slot.handle.stats.remote(), self._health_timeout_s))
            out.append(entry)
        return out

    async def alive(self) -> list[bool]:
        return [s.alive for s in self._slots]

    async def sticky_engine(self, episode_id: str) -> int | None:
        return self._sticky.get(episode_id)
