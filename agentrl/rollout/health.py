"""The health of a router's engines: which are live, and what happens when one dies.

An engine is *dead* when its actor died, its core died (vLLM's EngineDeadError, or health reporting `dead`), or it
stopped answering health checks. A dead engine is drained at once: its pending requests fail with
RetryableEngineError (never hang), nothing new goes to it, and fleet-wide calls (update_weights, pause, resume)
skip it instead of failing the run. An engine that is gone for good (actor or core dead, or stuck for
`stuck_checks` health rounds) is killed and restarted in the background through the `restart` factory, at most
`rollout.restart_engines` times per engine index; one that only failed health checks rejoins when it answers
again. Either way it first loads the latest weights: from disk at once, or, when weights arrive over a collective
(rollout.weight_sync), at the next weight sync, which includes engines awaiting weights (`status()` counts them, and
the pipeline syncs at once when one waits). Deaths, restarts and the time with no live engine are reported by
`status()`, which the pipeline polls every step through the router.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentrl.rollout.base import EngineError, WeightSource

log = logging.getLogger(__name__)

EngineFactory = Callable[[int], Any]
"""Makes a new (not yet started) engine actor for an engine index: the restart path."""


@dataclass(frozen=True)
class HealthPolicy:
    """How engines are watched: a health round every `interval_s`, each check within `timeout_s`; `stuck_checks`
    failed rounds in a row make an engine dead; a restarted engine has `start_timeout_s` to start and load, and a
    failed start is retried after `restart_backoff_s`; a request waits up to `no_engine_wait_s` for a live engine
    before failing, so callers retrying it back off instead of spinning."""

    interval_s: float = 2.0
    timeout_s: float = 10.0
    start_timeout_s: float = 900.0
    restart_backoff_s: float = 5.0
    stuck_checks: int = 3
    no_engine_wait_s: float = 5.0


@dataclass(eq=False)
class EngineSlot:
    index: int
    handle: Any
    alive: bool = True
    in_flight: int = 0
    tokens_in_flight: int = 0
    pending: set[asyncio.Future] = field(default_factory=set)
    failures: int = 0  # consecutive failed health checks
    gone: bool = False  # declared dead for good: restarted, given up, or rejoins only if it answers again
    dead: bool = False  # its actor or core died: it never answers again, whatever a late health reply said
    restarting: bool = False
    loaded: int = 0  # the weight update (router count) it holds; -1: none yet, it waits for the next sync
    serial: int = 0  # which engine this is (a restart makes a new one): the weight-sync group is rebuilt for it
    drains: int = 0  # times drained: with `serial`, the generation that voids the direct clients' older leases
    episodes: int = 0  # episodes placed here and not yet released (direct clients' turns are not in in_flight)

    @property
    def generation(self) -> tuple[int, int]:
        return (self.serial, self.drains)


def _is_actor_death(err: BaseException) -> bool:
    import ray.exceptions as rex

    return isinstance(err, rex.RayActorError | rex.ActorUnavailableError | rex.ActorDiedError)


def _is_core_death(err: BaseException) -> bool:
    """vLLM's EngineDeadError (or ours), raw or inside Ray's RayTaskError (whose class subclasses the cause's and
    whose `.cause` holds it). Matched by name so the router never imports vllm."""
    for e in (err, getattr(err, "cause", None)):
        if e is not None and any(c.__name__ == "EngineDeadError" for c in type(e).__mro__):
            return True
    return False


def is_engine_death(err: BaseException) -> bool:
    """The engine will never answer again: its actor or its core died."""
    return _is_actor_death(err) or _is_core_death(err)


def as_engine_error(index: int, err: Exception) -> EngineError:
    """What a failed engine call raises to its caller (other than a death): the engine's own EngineError, or one
    naming the engine."""
    if isinstance(err, EngineError):
        return err
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, EngineError) else EngineError(f"engine {index}: {err}")


def short_error(err: BaseException) -> str:
    """One line for an event: the cause's type and first message line (Ray's own str is a whole traceback)."""
    cause = getattr(err, "cause", None) or err
    lines = str(cause).strip().splitlines()
    text = f"{type(cause).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= 160 else text[:157] + "..."


def _restarts(n: int) -> str:
    return f"{n} restart" if n == 1 else f"{n} restarts"


def fleet_metrics(status: dict[str, Any]) -> dict[str, float]:
    """The metrics of a `Router.fleet_status()` answer, under their logged names."""
    return {
        "rollout/live_engines": float(status["live"]),
        "rollout/engine_deaths": float(status["deaths"]),
        "rollout/engine_restarts": float(status["restarts"]),
        "rollout/no_live_engine_s": float(status["no_live_s"]),
    }


class FleetHealth:
    """The engines' slots and their liveness: health rounds, deaths, drains, restarts and rejoins, and the latest
    weights a restarted or rejoining engine must load first. `on_drain(index)` tells the router to forget the
    episodes placed on a drained engine."""

    def __init__(
        self,
        engines: list[Any],
        policy: HealthPolicy,
        restart: EngineFactory | None,
        max_restarts: int,
        on_drain: Callable[[int], None],
    ) -> None:
        self.slots = [EngineSlot(i, h, serial=i) for i, h in enumerate(engines)]
        self.policy = policy
        self._restart = restart
        self._max_restarts = max_restarts if restart is not None else 0
        self.on_drain = on_drain
        self.weights: tuple[WeightSource, int] | None = None  # the latest update's source and version
        self.updates = 0  # weight updates so far; a slot's `loaded` says which one it holds
        self._serials = len(engines)
        self._attempts = [0] * len(engines)  # restart attempts per engine index, successful or not
        self._deaths = 0
        self._restarts = 0
        self._events: collections.deque[str] = collections.deque(maxlen=200)
        self._none_live_since: float | None = None
        self.live_again = asyncio.Event()
        self.live_again.set()
        self._health_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()  # background restarts (kept referenced until done)

    def live(self) -> list[EngineSlot]:
        return [s for s in self.slots if s.alive]

    def record_update(self, source: WeightSource, version: int) -> int:
        """A weight update is under way: engines that restart or rejoin from now on load it first."""
        self.updates += 1
        self.weights = (source, version)
        return self.updates

    def event(self, message: str) -> None:
        log.warning(message)
        self._events.append(message)

    def live_line(self) -> str:
        return f"{len(self.live())} of {len(self.slots)} live"

    def set_alive(self, slot: EngineSlot, alive: bool) -> None:
        slot.alive = alive
        if self.live():
            self._none_live_since = None
            self.live_again.set()
        else:
            self.live_again.clear()
            if self._none_live_since is None:
                self._none_live_since = time.monotonic()

    def drain(self, slot: EngineSlot) -> None:
        self.set_alive(slot, False)
        slot.drains += 1
        slot.episodes = 0
        for fut in list(slot.pending):
            fut.cancel()
        self.on_drain(slot.index)

    def on_death(self, slot: EngineSlot, why: str, *, gone: bool, dead: bool = False) -> None:
        """Count and drain a live engine that failed. `gone`: it will never serve again (actor or core `dead`,
        or stuck), so restart it if the budget allows; otherwise the health loop lets it rejoin when it answers."""
        slot.dead = slot.dead or dead
        if self.slots[slot.index] is not slot or slot.restarting:
            return  # a late error from an engine already replaced or being restarted
        was_alive = slot.alive
        if was_alive:
            self._deaths += 1
            self.drain(slot)
        if not gone:
            if was_alive:
                self.event(f"rollout engine {slot.index} failed a health check ({why}); {self.live_line()}")
            return
        if slot.gone:
            return
        slot.gone = True
        used = self._attempts[slot.index]
        if used < self._max_restarts:
            slot.restarting = True
            plan = f"restarting ({used + 1}/{self._max_restarts})"
            task = asyncio.ensure_future(self._restart_loop(slot))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif self._max_restarts:
            plan = f"gave up after {_restarts(used)}"
        else:
            plan = "not restarting"
        self.event(f"rollout engine {slot.index} died ({why}); {self.live_line()}; {plan}")

    # ---- restarts --------------------------------------------------------------------------------------------
    async def _restart_loop(self, slot: EngineSlot) -> None:
        """Kill the dead engine, start a new one with the latest weights and put it in the slot's place; retry a
        failed start (after restart_backoff_s) while the engine's budget lasts."""
        index = slot.index
        await self._kill(slot.handle)
        while self._attempts[index] < self._max_restarts:
            self._attempts[index] += 1
            attempt = self._attempts[index]
            handle = None
            try:
                handle = self._restart(index)
                await asyncio.wait_for(handle.start.remote(), self.policy.start_timeout_s)
                loaded = await self._load_latest(handle)
            except Exception as err:
                why = short_error(err)
                self.event(f"rollout engine {index} restart {attempt}/{self._max_restarts} failed ({why})")
                if handle is not None:
                    await self._kill(handle)
                await asyncio.sleep(self.policy.restart_backoff_s)
                continue
            if self.slots[index] is not slot:  # replace_engine() put another engine there meanwhile
                await self._kill(handle)
                return
            new = EngineSlot(index, handle, alive=False, loaded=loaded, serial=self._new_serial())
            self.slots[index] = new
            self._restarts += 1
            if loaded < 0:
                self.event(f"rollout engine {index} restarted; it joins at the next weight sync")
                return
            self.set_alive(new, True)
            self.event(f"rollout engine {index} restarted; {self.live_line()}")
            return
        slot.restarting = False
        self.event(f"rollout engine {index} gave up after {_restarts(self._max_restarts)}; {self.live_line()}")

    async def _kill(self, handle: Any) -> None:
        """Free what a dead engine still holds (device memory, its core's processes): a polite shutdown, then
        ray.kill."""
        import ray

        with contextlib.suppress(Exception):
            await asyncio.wait_for(handle.shutdown.remote(), self.policy.timeout_s)
        with contextlib.suppress(Exception):
            ray.kill(handle)

    def _new_serial(self) -> int:
        self._serials += 1
        return self._serials

    async def _load_latest(self, handle: Any, holds: int = -1) -> int:
        """Bring an engine holding weight update `holds` up to the latest one, again if an update arrived meanwhile;
        returns the update it now holds. Weights that came over a collective cannot be re-read: then it returns
        -1 and the engine waits for the next sync."""
        while self.weights is not None and holds != self.updates:
            (source, version), target = self.weights, self.updates
            if isinstance(source, dict):
                return -1
            await asyncio.wait_for(handle.update_weights.remote(source, version, "abort"), self.policy.start_timeout_s)
            holds = target
        return self.updates if self.weights is None else holds

    # ---- health ----------------------------------------------------------------------------------------------
    def ensure_loop(self) -> None:
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.ensure_future(self._health_loop())

    async def _health_loop(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.policy.interval_s)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(slot) for slot in self.slots if not slot.restarting))

    async def check(self, slot: EngineSlot) -> None:
        try:
            status = await asyncio.wait_for(slot.handle.health.remote(), self.policy.timeout_s)
        except Exception as err:
            slot.failures += 1
            if is_engine_death(err):
                self.on_death(slot, short_error(err), gone=True, dead=True)
            else:
                why = "health check timed out" if isinstance(err, TimeoutError) else short_error(err)
                self.on_death(slot, why, gone=False)
                if slot.failures >= self.policy.stuck_checks:
                    self.on_death(slot, f"stuck: {slot.failures} failed health checks", gone=True)
            return
        if status.get("dead"):
            self.on_death(slot, "EngineDeadError: its health check reports the core dead", gone=True, dead=True)
        elif not status.get("ok", False):
            slot.failures += 1
            self.on_death(slot, "health not ok", gone=False)
        else:
            slot.failures = 0
            if not slot.alive and not slot.dead:  # an OK sent just before the engine died must not revive it
                await self._rejoin(slot)

    async def _rejoin(self, slot: EngineSlot) -> None:
        if slot.loaded < 0:
            return  # waits for the next weight sync
        try:
            loaded = await self._load_latest(slot.handle, slot.loaded)
        except Exception as err:
            log.warning("rollout engine %d could not rejoin: %s", slot.index, short_error(err))
            return
        if self.slots[slot.index] is slot and not slot.alive and not slot.dead:
            slot.gone, slot.loaded = False, loaded
            if loaded < 0:
                self.event(f"rollout engine {slot.index} answers again; it joins at the next weight sync")
                return
            self.set_alive(slot, True)
            self.event(f"rollout engine {slot.index} rejoined; {self.live_line()}")

    def replace_engine(self, index: int, handle: Any) -> None:
        """Swap in an engine started elsewhere; it rejoins at the next health round with the latest weights."""
        self.drain(self.slots[index])
        self.slots[index] = EngineSlot(
            index, handle, alive=False, loaded=-1 if self.updates else 0, serial=self._new_serial()
        )

    def status(self) -> dict[str, Any]:
        """Live/total engines, cumulative deaths and successful restarts, engines restarting now, seconds with no
        live engine (0.0 while one is live) and the event lines since the previous call (cleared here). The
        pipeline polls it every step and stops the run when no_live_s exceeds rollout.no_engine_timeout_s;
        `awaiting_weights` engines wait for the next collective weight sync."""
        events = list(self._events)
        self._events.clear()
        since = self._none_live_since
        return {
            "live": len(self.live()),
            "total": len(self.slots),
            "deaths": self._deaths,
            "restarts": self._restarts,
            "restarting": sum(s.restarting for s in self.slots),
            "awaiting_weights": len(self.awaiting()),
            "no_live_s": 0.0 if since is None else time.monotonic() - since,
            "events": events,
        }

    def awaiting(self) -> list[EngineSlot]:
        """Engines that answer but hold no current weights (restarted while weights came over a collective)."""
        return [s for s in self.slots if not s.alive and not s.dead and not s.restarting and s.loaded < 0]
