"""Router over N engine actors: sticky episodes, least-loaded placement, health checks, drain and restart on death.

An episode id sticks to one engine so its growing prompt reuses that engine's prefix cache. New episodes go to
the live engine with the fewest requests (then tokens) in flight.

Faults. An engine is *dead* when its actor died, its core died (vLLM's EngineDeadError, or health reporting
`dead`), or it stopped answering health checks. A dead engine is drained at once: its pending requests fail with
RetryableEngineError (never hang), nothing new goes to it, and fleet-wide calls (update_weights, pause, resume)
skip it instead of failing the run. An engine that is gone for good (actor or core dead, or stuck for
`stuck_checks` health rounds) is killed and restarted in the background through the `restart` factory, at most
`max_restarts` times per engine index; one that only failed health checks rejoins when it answers again. Either
way it first loads the latest weights: from disk at once, or, when weights arrive over a collective
(rollout.weight_sync), at the next weight sync, which includes engines awaiting weights (`fleet_status()`
counts them, and the pipeline syncs at once when one waits). Deaths, restarts and the time with no live engine are
reported by `fleet_status()`, which the pipeline polls every step.
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

from agentrl.config.schema import SamplingConfig
from agentrl.rollout.base import DrainMode, EngineError, Lease, RetryableEngineError, WeightSource
from agentrl.types import GenOutput

log = logging.getLogger(__name__)

EngineFactory = Callable[[int], Any]
"""Makes a new (not yet started) engine actor for an engine index: the router's restart path."""


@dataclass(eq=False)
class _Slot:
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


class Router:
    def __init__(
        self,
        engines: list[Any],
        *,
        health_interval_s: float = 2.0,
        health_timeout_s: float = 10.0,
        request_timeout_s: float = 300.0,
        restart: EngineFactory | None = None,
        max_restarts: int = 0,
        start_timeout_s: float = 900.0,
        restart_backoff_s: float = 5.0,
        stuck_checks: int = 3,
        no_engine_wait_s: float = 5.0,
    ):
        """`restart` and `max_restarts` (rollout.restart_engines) enable restarts; `stuck_checks` failed health
        rounds in a row make an engine dead; `no_engine_wait_s` bounds how long a request waits for a live engine
        before failing, so callers retrying it back off instead of spinning."""
        if not engines:
            raise ValueError("the router needs at least one engine")
        self._slots = [_Slot(i, h, serial=i) for i, h in enumerate(engines)]
        self._sticky: dict[str, int] = {}
        self._health_interval_s = health_interval_s
        self._health_timeout_s = health_timeout_s
        self._request_timeout_s = request_timeout_s
        self._restart = restart
        self._max_restarts = max_restarts if restart is not None else 0
        self._start_timeout_s = start_timeout_s
        self._restart_backoff_s = restart_backoff_s
        self._stuck_checks = stuck_checks
        self._no_engine_wait_s = no_engine_wait_s
        self._health_task: asyncio.Task | None = None
        self._weights: tuple[WeightSource, int] | None = None
        self._updates = 0  # weight updates so far; a slot's `loaded` says which one it holds
        self._serials = len(engines)
        self._sync_info: dict[int, dict[str, Any]] = {}  # slot serial -> its weight_sync_info()
        self._attempts = [0] * len(engines)  # restart attempts per engine index, successful or not
        self._deaths = 0
        self._restarts = 0
        self._events: collections.deque[str] = collections.deque(maxlen=200)
        self._none_live_since: float | None = None
        self._live_again = asyncio.Event()
        self._live_again.set()
        self._tasks: set[asyncio.Task] = set()  # background restarts (kept referenced until done)

    # ---- placement -------------------------------------------------------------------------------------------
    def _live(self) -> list[_Slot]:
        return [s for s in self._slots if s.alive]

    def _pick(self, episode_id: str) -> _Slot | None:
        index = self._sticky.get(episode_id)
        if index is not None and self._slots[index].alive:
            return self._slots[index]
        live = self._live()
        if not live:
            return None
        slot = min(live, key=lambda s: (s.episodes + s.in_flight, s.tokens_in_flight, s.index))
        self._sticky[episode_id] = slot.index
        slot.episodes += 1
        return slot

    async def _pick_or_wait(self, episode_id: str) -> _Slot:
        """A live engine for the episode, waiting up to no_engine_wait_s for one to (re)join rather than failing
        at once: with no engine live, callers that retry would otherwise spin."""
        deadline = time.monotonic() + self._no_engine_wait_s
        while (slot := self._pick(episode_id)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RetryableEngineError("no live rollout engine")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._live_again.wait(), left)
        return slot

    def release(self, episode_ids: list[str]) -> None:
        """Forget finished episodes' engines."""
        for episode_id in episode_ids:
            index = self._sticky.pop(episode_id, None)
            if index is not None:
                slot = self._slots[index]
                slot.episodes = max(0, slot.episodes - 1)

    async def lease(self, episode_ids: list[str]) -> list[Lease]:
        """Each episode's engine, placed one by one as before, for a direct client (agentrl.rollout.engine_client)
        to send its turns to. Clients ask for many episodes per call: one call per episode (and one per release)
        was ~1/8 of an env manager's CPU and most of this actor's calls."""
        self._ensure_health_loop()
        leases = []
        for episode_id in episode_ids:
            slot = await self._pick_or_wait(episode_id)
            leases.append(Lease(slot.index, slot.generation, slot.handle))
        return leases

    def engine_view(self) -> dict[int, tuple[tuple[int, int], bool]]:
        """Each engine's generation and whether it is live: what direct clients poll to void their leases."""
        return {s.index: (s.generation, s.alive) for s in self._slots}

    def report_death(self, index: int, generation: tuple[int, int], why: str) -> None:
        """A direct client's call found the engine's actor or core dead: drain and restart it as the health loop
        would (a late report about an engine already replaced is ignored)."""
        slot = self._slots[index]
        if slot.serial == generation[0]:
            self._on_death(slot, why, gone=True, dead=True)

    # ---- requests --------------------------------------------------------------------------------------------
    async def generate(
        self, episode_id: str, token_ids: list[int], sampling: SamplingConfig, request_id: str
    ) -> GenOutput:
        self._ensure_health_loop()
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

    async def _call(self, slot: _Slot, method: str, *args: Any) -> Any:
        try:
            return await getattr(slot.handle, method).remote(*args)
        except Exception as err:
            if is_engine_death(err):
                self._on_death(slot, short_error(err), gone=True, dead=True)
                raise RetryableEngineError(f"engine {slot.index} died") from err
            raise as_engine_error(slot.index, err) from err

    # ---- liveness bookkeeping --------------------------------------------------------------------------------
    def _event(self, message: str) -> None:
        log.warning(message)
        self._events.append(message)

    def _live_line(self) -> str:
        return f"{len(self._live())} of {len(self._slots)} live"

    def _set_alive(self, slot: _Slot, alive: bool) -> None:
        slot.alive = alive
        if self._live():
            self._none_live_since = None
            self._live_again.set()
        else:
            self._live_again.clear()
            if self._none_live_since is None:
                self._none_live_since = time.monotonic()

    def _drain(self, slot: _Slot) -> None:
        self._set_alive(slot, False)
        slot.drains += 1
        slot.episodes = 0
        for fut in list(slot.pending):
            fut.cancel()
        for episode, index in list(self._sticky.items()):
            if index == slot.index:
                del self._sticky[episode]

    def _on_death(self, slot: _Slot, why: str, *, gone: bool, dead: bool = False) -> None:
        """Count and drain a live engine that failed. `gone`: it will never serve again (actor or core `dead`,
        or stuck), so restart it if the budget allows; otherwise the health loop lets it rejoin when it answers."""
        slot.dead = slot.dead or dead
        if self._slots[slot.index] is not slot or slot.restarting:
            return  # a late error from an engine already replaced or being restarted
        was_alive = slot.alive
        if was_alive:
            self._deaths += 1
            self._drain(slot)
        if not gone:
            if was_alive:
                self._event(f"rollout engine {slot.index} failed a health check ({why}); {self._live_line()}")
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
        self._event(f"rollout engine {slot.index} died ({why}); {self._live_line()}; {plan}")

    # ---- restarts --------------------------------------------------------------------------------------------
    async def _restart_loop(self, slot: _Slot) -> None:
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
                await asyncio.wait_for(handle.start.remote(), self._start_timeout_s)
                loaded = await self._load_latest(handle)
            except Exception as err:
                why = short_error(err)
                self._event(f"rollout engine {index} restart {attempt}/{self._max_restarts} failed ({why})")
                if handle is not None:
                    await self._kill(handle)
                await asyncio.sleep(self._restart_backoff_s)
                continue
            if self._slots[index] is not slot:  # replace_engine() put another engine there meanwhile
                await self._kill(handle)
                return
            new = _Slot(index, handle, alive=False, loaded=loaded, serial=self._new_serial())
            self._slots[index] = new
            self._restarts += 1
            if loaded < 0:
                self._event(f"rollout engine {index} restarted; it joins at the next weight sync")
                return
            self._set_alive(new, True)
            self._event(f"rollout engine {index} restarted; {self._live_line()}")
            return
        slot.restarting = False
        self._event(f"rollout engine {index} gave up after {_restarts(self._max_restarts)}; {self._live_line()}")

    async def _kill(self, handle: Any) -> None:
        """Free what a dead engine still holds (device memory, its core's processes): a polite shutdown, then
        ray.kill."""
        import ray

        with contextlib.suppress(Exception):
            await asyncio.wait_for(handle.shutdown.remote(), self._health_timeout_s)
        with contextlib.suppress(Exception):
            ray.kill(handle)

    def _new_serial(self) -> int:
        self._serials += 1
        return self._serials

    async def _load_latest(self, handle: Any, holds: int = -1) -> int:
        """Bring an engine holding weight update `holds` up to the latest one, again if an update arrived meanwhile;
        returns the update it now holds. Weights that came over a collective cannot be re-read: then it returns
        -1 and the engine waits for the next sync."""
        while self._weights is not None and holds != self._updates:
            (source, version), target = self._weights, self._updates
            if isinstance(source, dict):
                return -1
            await asyncio.wait_for(handle.update_weights.remote(source, version, "abort"), self._start_timeout_s)
            holds = target
        return self._updates if self._weights is None else holds

    # ---- health ----------------------------------------------------------------------------------------------
    def _ensure_health_loop(self) -> None:
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.ensure_future(self._health_loop())

    async def _health_loop(self) -> None:
        while True:
            await self._check_all()
            await asyncio.sleep(self._health_interval_s)

    async def _check_all(self) -> None:
        await asyncio.gather(*(self._check(slot) for slot in self._slots if not slot.restarting))

    async def _check(self, slot: _Slot) -> None:
        try:
            status = await asyncio.wait_for(slot.handle.health.remote(), self._health_timeout_s)
        except Exception as err:
            slot.failures += 1
            if is_engine_death(err):
                self._on_death(slot, short_error(err), gone=True, dead=True)
            else:
                why = "health check timed out" if isinstance(err, TimeoutError) else short_error(err)
                self._on_death(slot, why, gone=False)
                if slot.failures >= self._stuck_checks:
                    self._on_death(slot, f"stuck: {slot.failures} failed health checks", gone=True)
            return
        if status.get("dead"):
            self._on_death(slot, "EngineDeadError: its health check reports the core dead", gone=True, dead=True)
        elif not status.get("ok", False):
            slot.failures += 1
            self._on_death(slot, "health not ok", gone=False)
        else:
            slot.failures = 0
            if not slot.alive and not slot.dead:  # an OK sent just before the engine died must not revive it
                await self._rejoin(slot)

    async def _rejoin(self, slot: _Slot) -> None:
        if slot.loaded < 0:
            return  # waits for the next weight sync
        try:
            loaded = await self._load_latest(slot.handle, slot.loaded)
        except Exception as err:
            log.warning("rollout engine %d could not rejoin: %s", slot.index, short_error(err))
            return
        if self._slots[slot.index] is slot and not slot.alive and not slot.dead:
            slot.gone, slot.loaded = False, loaded
            if loaded < 0:
                self._event(f"rollout engine {slot.index} answers again; it joins at the next weight sync")
                return
            self._set_alive(slot, True)
            self._event(f"rollout engine {slot.index} rejoined; {self._live_line()}")

    async def check_health(self) -> list[bool]:
        """Run one health round now (tests and the pipeline call it after replacing an engine)."""
        await self._check_all()
        return [s.alive for s in self._slots]

    def replace_engine(self, index: int, handle: Any) -> None:
        """Swap in an engine started elsewhere; it rejoins at the next health round with the latest weights."""
        self._drain(self._slots[index])
        self._slots[index] = _Slot(
            index, handle, alive=False, loaded=-1 if self._updates else 0, serial=self._new_serial()
        )

    async def fleet_status(self) -> dict[str, Any]:
        """Live/total engines, cumulative deaths and successful restarts, engines restarting now, seconds with no
        live engine (0.0 while one is live) and the event lines since the previous call (cleared here). The
        pipeline polls it every step and stops the run when no_live_s exceeds rollout.no_engine_timeout_s;
        `awaiting_weights` engines wait for the next collective weight sync."""
        self._ensure_health_loop()
        events = list(self._events)
        self._events.clear()
        since = self._none_live_since
        return {
            "live": len(self._live()),
            "total": len(self._slots),
            "deaths": self._deaths,
            "restarts": self._restarts,
            "restarting": sum(s.restarting for s in self._slots),
            "awaiting_weights": len(self._awaiting()),
            "no_live_s": 0.0 if since is None else time.monotonic() - since,
            "events": events,
        }

    # ---- fleet-wide control ----------------------------------------------------------------------------------
    async def _each_live(self, method: str, *args: Any) -> list[Any]:
        """Call every live engine; a dead one is drained and skipped, any other engine error propagates."""
        self._ensure_health_loop()
        results = await asyncio.gather(*(self._call(s, method, *args) for s in self._live()), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, RetryableEngineError)]
        if errors:
            raise errors[0]
        return [r for r in results if not isinstance(r, BaseException)]

    def _awaiting(self) -> list[_Slot]:
        """Engines that answer but hold no current weights (restarted while weights came over a collective)."""
        return [s for s in self._slots if not s.alive and not s.dead and not s.restarting and s.loaded < 0]

    async def weight_sync_members(self) -> dict[str, Any]:
        """Who takes part in the next collective weight sync (live engines and those awaiting weights), in rank
        order: `members` [(index, serial, workers)], whether they all receive a `collective` broadcast, and their
        `dtype` (None: unknown). The driver sizes the group from it and passes `members` back to update_weights."""
        members = []
        for slot in [*self._live(), *self._awaiting()]:
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
        slots = [self._slots[i] for i, serial, _ in members if self._slots[i].serial == serial]
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
        self._updates += 1
        self._weights = (source, version)
        t0 = time.perf_counter()
        if not isinstance(source, dict):
            await self._each_live("update_weights", source, version, drain)
            for slot in self._live():
                slot.loaded = self._updates
            return time.perf_counter() - t0
        calls, first_rank = [], 1
        for index, serial, workers in members or []:
            slot = self._slots[index]
            if slot.serial == serial:
                calls.append(
                    (slot, self._call(slot, "update_weights", {**source, "first_rank": first_rank}, version, drain))
                )
            first_rank += workers
        results = await asyncio.gather(*(call for _, call in calls), return_exceptions=True)
        for (slot, _), result in zip(calls, results, strict=True):
            if isinstance(result, BaseException):
                continue
            slot.loaded = self._updates
            if not slot.alive and not slot.dead and self._slots[slot.index] is slot:
                slot.gone = False
                self._set_alive(slot, True)
                self._event(f"rollout engine {slot.index} has the new weights and serves again; {self._live_line()}")
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
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
