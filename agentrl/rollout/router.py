"""Router over N engine actors: sticky episodes, least-loaded placement, and fleet-wide calls (weights, pause).

An episode id sticks to one engine so its growing prompt reuses that engine's prefix cache. New episodes go to
the live engine with the fewest requests (then tokens) in flight. Which engines are live, and what happens when
one dies (drain, restart, rejoin), is `agentrl.rollout.health`'s: the router asks it and reports deaths to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from agentrl.config.schema import RolloutConfig, SamplingConfig
from agentrl.rollout.base import DrainMode, EngineError, Lease, RetryableEngineError, WeightSource
from agentrl.rollout.health import (
    EngineFactory,
    EngineSlot,
    FleetHealth,
    HealthPolicy,
    as_engine_error,
    is_engine_death,
    short_error,
)
from agentrl.types import GenOutput


class Router:
    def __init__(
        self,
        engines: list[Any],
        cfg: RolloutConfig | None = None,
        *,
        restart: EngineFactory | None = None,
        health: HealthPolicy | None = None,
    ):
        """`restart` (a factory of new engine actors) lets dead engines be restarted, up to
        `cfg.restart_engines` times each; `health` says how they are watched."""
        if not engines:
            raise ValueError("the router needs at least one engine")
        cfg = cfg or RolloutConfig()
        self.health = FleetHealth(engines, health or HealthPolicy(), restart, cfg.restart_engines, self._forget)
        self._sticky: dict[str, int] = {}
        self._request_timeout_s = cfg.request_timeout_s
        self._sync_info: dict[int, dict[str, Any]] = {}  # slot serial -> its weight_sync_info()

    # ---- placement -------------------------------------------------------------------------------------------
    def _forget(self, index: int) -> None:
        """A drained engine's episodes are placed anew at their next turn."""
        for episode, placed in list(self._sticky.items()):
            if placed == index:
                del self._sticky[episode]

    def _pick(self, episode_id: str) -> EngineSlot | None:
        index = self._sticky.get(episode_id)
        slots = self.health.slots
        if index is not None and slots[index].alive:
            return slots[index]
        live = self.health.live()
        if not live:
            return None
        slot = min(live, key=lambda s: (s.episodes + s.in_flight, s.tokens_in_flight, s.index))
        self._sticky[episode_id] = slot.index
        slot.episodes += 1
        return slot

    async def _pick_or_wait(self, episode_id: str) -> EngineSlot:
        """A live engine for the episode, waiting up to no_engine_wait_s for one to (re)join rather than failing
        at once: with no engine live, callers that retry would otherwise spin."""
        deadline = time.monotonic() + self.health.policy.no_engine_wait_s
        while (slot := self._pick(episode_id)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RetryableEngineError("no live rollout engine")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.health.live_again.wait(), left)
        return slot

    def release(self, episode_ids: list[str]) -> None:
        """Forget finished episodes' engines."""
        for episode_id in episode_ids:
            index = self._sticky.pop(episode_id, None)
            if index is not None:
                slot = self.health.slots[index]
                slot.episodes = max(0, slot.episodes - 1)

    async def lease(self, episode_ids: list[str]) -> list[Lease]:
        """Each episode's engine, placed one by one as before, for a direct client (agentrl.rollout.engine_client)
        to send its turns to. Clients ask for many episodes per call: one call per episode (and one per release)
        was ~1/8 of an env manager's CPU and most of this actor's calls."""
        self.health.ensure_loop()
        leases = []
        for episode_id in episode_ids:
            slot = await self._pick_or_wait(episode_id)
            leases.append(Lease(slot.index, slot.generation, slot.handle))
        return leases

    def engine_view(self) -> dict[int, tuple[tuple[int, int], bool]]:
        """Each engine's generation and whether it is live: what direct clients poll to void their leases."""
        return {s.index: (s.generation, s.alive) for s in self.health.slots}

    def report_death(self, index: int, generation: tuple[int, int], why: str) -> None:
        """A direct client's call found the engine's actor or core dead: drain and restart it as the health loop
        would (a late report about an engine already replaced is ignored)."""
        slot = self.health.slots[index]
        if slot.serial == generation[0]:
            self.health.on_death(slot, why, gone=True, dead=True)

    # ---- requests --------------------------------------------------------------------------------------------
    async def generate(
        self, episode_id: str, token_ids: list[int], sampling: SamplingConfig, request_id: str
    ) -> GenOutput:
        self.health.ensure_loop()
        slot = await self._pick_or_wait(episode_id)
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

    async def _call(self, slot: EngineSlot, method: str, *args: Any) -> Any:
        try:
            return await getattr(slot.handle, method).remote(*args)
        except Exception as err:
            if is_engine_death(err):
                self.health.on_death(slot, short_error(err), gone=True, dead=True)
                raise RetryableEngineError(f"engine {slot.index} died") from err
            raise as_engine_error(slot.index, err) from err

    # ---- health (health.FleetHealth) -------------------------------------------------------------------------
    async def check_health(self) -> list[bool]:
        """Run one health round now (tests and the pipeline call it after replacing an engine)."""
        await self.health.check_all()
        return [s.alive for s in self.health.slots]

    def replace_engine(self, index: int, handle: Any) -> None:
        """Swap in an engine started elsewhere; it rejoins at the next health round with the latest weights."""
        self.health.replace_engine(index, handle)

    async def fleet_status(self) -> dict[str, Any]:
        """`FleetHealth.status()`: live and total engines, deaths, restarts, engines awaiting weights, seconds with
        no live engine, and the event lines since the previous call."""
        self.health.ensure_loop()
        return self.health.status()

    # ---- fleet-wide control ----------------------------------------------------------------------------------
    async def _each_live(self, method: str, *args: Any) -> list[Any]:
        """Call every live engine; a dead one is drained and skipped, any other engine error propagates."""
        self.health.ensure_loop()
        calls = [self._call(s, method, *args) for s in self.health.live()]
        results = await asyncio.gather(*calls, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, RetryableEngineError)]
        if errors:
            raise errors[0]
        return [r for r in results if not isinstance(r, BaseException)]

    async def weight_sync_members(self) -> dict[str, Any]:
        """Who takes part in the next collective weight sync (live engines and those awaiting weights), in rank
        order: `members` [(index, serial, workers)], whether they all receive a `collective` broadcast, and their
        `dtype` (None: unknown). The driver sizes the group from it and passes `members` back to update_weights."""
        members = []
        for slot in [*self.health.live(), *self.health.awaiting()]:
            if slot.serial not in self._sync_info:
                try:
                    self._sync_info[slot.serial] = await self._call(slot, "weight_sync_info")
                except RetryableEngineError:
                    continue  # it died just now: drained and counted; the sync goes on without it
            members.append((slot, self._sync_info[slot.serial]))
        infos = [info for _, info in members]
        dtypes = {info["dtype"] for info in infos if info.get("dtype")}
        if len(dtypes) > 1:
            raise EngineError(f"engines compute in different dtypes {sorted(dtypes)}: one broadcast cannot serve them")
        return {
            "members": [(slot.index, slot.serial, int(info["workers"])) for slot, info in members],
            "collective": all(info.get("collective") for info in infos),
            "dtype": dtypes.pop() if dtypes else None,
        }

    async def hold(self, members: list, drain: DrainMode = "abort") -> list:
        """Close the gates of `members` (from weight_sync_members) and drain them; returns those held (an engine
        that died meanwhile is left out, drained and counted), which then form the weight-sync group."""
        slots = [self.health.slots[i] for i, serial, _ in members if self.health.slots[i].serial == serial]
        results = await asyncio.gather(*(self._call(s, "hold", drain) for s in slots), return_exceptions=True)
        held = {s.serial for s, r in zip(slots, results, strict=True) if not isinstance(r, BaseException)}
        errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, RetryableEngineError)]
        if errors:
            raise errors[0]
        return [m for m in members if m[1] in held]

    async def update_weights(
        self, source: WeightSource, version: int, drain: DrainMode = "abort", members: list | None = None
    ) -> float:
        """Update every live engine (disk), or every engine in `members` (a collective sync: each gets its first
        rank in the group, and one awaiting weights goes live once loaded); returns the slowest engine's seconds.
        Engines restarting or rejoining later load disk weights first; collective ones wait for the next sync."""
        update = self.health.record_update(source, version)
        t0 = time.perf_counter()
        if not isinstance(source, dict):
            await self._each_live("update_weights", source, version, drain)
            for slot in self.health.live():
                slot.loaded = update
            return time.perf_counter() - t0
        calls, first_rank = [], 1
        for index, serial, workers in members or []:
            slot = self.health.slots[index]
            if slot.serial == serial:
                calls.append(
                    (slot, self._call(slot, "update_weights", {**source, "first_rank": first_rank}, version, drain))
                )
            first_rank += workers
        results = await asyncio.gather(*(call for _, call in calls), return_exceptions=True)
        for (slot, _), result in zip(calls, results, strict=True):
            if isinstance(result, BaseException):
                continue
            slot.loaded = update
            if not slot.alive and not slot.dead and self.health.slots[slot.index] is slot:
                slot.gone = False
                self.health.set_alive(slot, True)
                live = self.health.live_line()
                self.health.event(f"rollout engine {slot.index} has the new weights and serves again; {live}")
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        return time.perf_counter() - t0
