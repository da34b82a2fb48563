"""The env managers' path to the engines: turns go straight to the episode's engine, many per Ray call.

The router places each episode once (`Router.lease`: sticky, least-loaded; the episodes that start together in one
call, and their releases likewise) and keeps health, drain, restarts and weight updates; the turns then go from the
env manager to that engine directly, instead of through the router (two Ray hops per turn, and the router's process
busy with every token list). Per engine, the client keeps one `_Channel`: turns queued while a `submit` call is
under way go together in the next one, and one `collect` call at a time brings back every turn finished meanwhile
(`agentrl.rollout.turn_mailbox`, the engine's side). Faults keep the router's rules:

- a dead actor or core found by a call is reported to the router (`report_death`), which drains and restarts
  it like one its own health loop found; the turn fails with RetryableEngineError, and the retry is placed anew;
- the client polls the router's view of the fleet (`engine_view`, every `poll_s`): a turn on an engine that was
  drained meanwhile (stuck, failed health checks, replaced) fails with RetryableEngineError at once, never hangs;
- a turn still running after `request_timeout_s` fails with RetryableEngineError, as through the router; a turn
  the client stops waiting for is cancelled on the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

from agentrl.config.schema import SamplingConfig
from agentrl.rollout.base import Lease, RetryableEngineError
from agentrl.rollout.health import as_engine_error, is_engine_death, short_error
from agentrl.rollout.turn_mailbox import TurnRequest
from agentrl.types import GenOutput

COLLECT_WAIT_S = 1.0  # a collect call returns empty after this long: the channel notices when it has no turn left


class _Channel:
    """One engine as this client sees it: turns queued for the next `submit`, futures awaiting their result."""

    def __init__(self, lease: Lease) -> None:
        # Its own box on the engine: a collect call still out from a closed channel to the same engine (drained,
        # then back) must not take this channel's results.
        self.client, self.handle = uuid.uuid4().hex, lease.handle
        self.waiting: dict[str, asyncio.Future] = {}
        self.queued: list[TurnRequest] = []
        self.cancelled: list[str] = []  # turns no one waits for any more: stopped by the next submit
        self.sender: asyncio.Task | None = None
        self.collector: asyncio.Task | None = None
        self.closed = False

    def send(self, rid: str, token_ids: list[int], sampling: SamplingConfig) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.waiting[rid] = fut
        self.queued.append((rid, token_ids, sampling))
        self._start_sender()
        if self.collector is None or self.collector.done():
            self.collector = asyncio.ensure_future(self._collect())
        return fut

    def _start_sender(self) -> None:
        if self.sender is None or self.sender.done():
            self.sender = asyncio.ensure_future(self._submit())

    def forget(self, rid: str) -> None:
        """The caller stopped waiting (timeout, drain, cancellation): stop the request on the engine too."""
        fut = self.waiting.pop(rid, None)
        if fut is not None and not fut.done():
            fut.cancel()
        if not self.closed:  # a closed channel's engine was drained: the router aborts or replaces it
            self.cancelled.append(rid)
            self._start_sender()

    def close(self) -> None:
        self.closed = True
        for fut in self.waiting.values():
            fut.cancel()
        self.waiting.clear()
        for task in (self.sender, self.collector):
            if task is not None:
                task.cancel()

    async def _submit(self) -> None:
        await asyncio.sleep(0)  # turns queued in this turn of the event loop go in the same call
        while self.queued or self.cancelled:
            (batch, self.queued), (cancel, self.cancelled) = (self.queued, []), (self.cancelled, [])
            try:
                await self.handle.submit.remote(self.client, batch, cancel)
            except Exception as err:  # a dead engine: the cancelled turns need nothing more
                self._fail([rid for rid, _, _ in batch], err)

    async def _collect(self) -> None:
        while self.waiting:
            try:
                results = await self.handle.collect.remote(self.client, COLLECT_WAIT_S)
            except Exception as err:
                self._fail(list(self.waiting), err)
                return
            for rid, result in results:
                fut = self.waiting.pop(rid, None)
                if fut is None or fut.done():
                    continue
                if isinstance(result, BaseException):
                    fut.set_exception(result)
                else:
                    fut.set_result(result)

    def _fail(self, rids: list[str], err: Exception) -> None:
        for rid in rids:
            fut = self.waiting.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_exception(err)


class EngineClient:
    def __init__(self, router: Any, *, request_timeout_s: float = 300.0, poll_s: float = 0.25):
        self.router = router
        self.request_timeout_s = request_timeout_s
        self.poll_s = poll_s
        self._leases: dict[str, Lease] = {}
        self._fleet: dict[int, tuple[tuple[int, int], bool]] = {}  # index -> (generation, alive), as last polled
        self._channels: dict[tuple[int, tuple[int, int]], _Channel] = {}
        self._poller: asyncio.Task | None = None
        self._leasing: dict[str, asyncio.Future] = {}  # episodes waiting for the next lease call
        self._leaser: asyncio.Task | None = None
        self._released: list[str] = []  # episodes over, for the next release call (a group's end together)

    async def generate(self, episode_id: str, token_ids: list[int], sampling: SamplingConfig, rid: str) -> GenOutput:
        self._ensure_poller()
        lease = await self._lease(episode_id)
        key = (lease.index, lease.generation)
        channel = self._channels.get(key)
        if channel is None:
            channel = self._channels[key] = _Channel(lease)
        fut = channel.send(rid, list(token_ids), sampling)
        try:
            out = await asyncio.wait_for(fut, self.request_timeout_s)
        except asyncio.CancelledError:
            channel.forget(rid)
            if self._void(lease):
                self._leases.pop(episode_id, None)
                raise RetryableEngineError(f"engine {lease.index} was drained") from None
            raise
        except TimeoutError:
            channel.forget(rid)
            raise RetryableEngineError(f"engine {lease.index}: request {rid} timed out") from None
        except Exception as err:
            error = self._engine_error(lease, err)
            if isinstance(error, RetryableEngineError):
                self._leases.pop(episode_id, None)
            raise error from err
        out.engine = lease.index
        return out

    def release(self, episode_id: str) -> None:
        """The episode is over: forget its engine here and, with the others released in this turn of the event
        loop, at the router."""
        self._leases.pop(episode_id, None)
        if not self._released:  # the first this turn of the loop: send them all once the turn's callbacks ran
            asyncio.get_running_loop().call_soon(self._send_releases)
        self._released.append(episode_id)

    async def close(self) -> None:
        self._send_releases()
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._poller

    # ---- internals -------------------------------------------------------------------------------------------
    async def _lease(self, episode_id: str) -> Lease:
        lease = self._leases.get(episode_id)
        if lease is None or self._void(lease):
            waiting = self._leasing.get(episode_id)
            if waiting is None:
                waiting = self._leasing[episode_id] = asyncio.get_running_loop().create_future()
                if self._leaser is None or self._leaser.done():
                    self._leaser = asyncio.ensure_future(self._lease_queued())
            lease = await waiting
            self._leases[episode_id] = lease
        return lease

    async def _lease_queued(self) -> None:
        """One router call for every episode that asked for a lease in this turn of the event loop (a group's
        episodes start together)."""
        await asyncio.sleep(0)
        while self._leasing:
            batch, self._leasing = self._leasing, {}
            self._send_releases()  # an episode released before these leases is forgotten before they are placed
            try:
                leases = await self.router.lease.remote(list(batch))
            except Exception as err:  # e.g. no live engine: every episode in the call retries as it did alone
                leases = [err] * len(batch)
            for fut, lease in zip(batch.values(), leases, strict=True):
                if fut.done():  # its episode was cancelled meanwhile; the manager releases it
                    continue
                if isinstance(lease, BaseException):
                    fut.set_exception(lease)
                else:
                    fut.set_result(lease)

    def _send_releases(self) -> None:
        if self._released:
            ids, self._released = self._released, []
            self.router.release.remote(ids)

    def _void(self, lease: Lease) -> bool:
        """Whether the last poll saw the lease's engine drained or replaced. A lease newer than the poll (made
        after it) stands until the next one."""
        seen = self._fleet.get(lease.index)
        if seen is None or lease.generation > seen[0]:
            return False
        generation, alive = seen
        return not alive or generation != lease.generation

    def _engine_error(self, lease: Lease, err: Exception) -> Exception:
        """A death is reported to the router and retryable; any other failure names the engine."""
        if is_engine_death(err):
            self._channels.pop((lease.index, lease.generation), None)
            self._fleet[lease.index] = (lease.generation, False)
            self.router.report_death.remote(lease.index, lease.generation, short_error(err))
            return RetryableEngineError(f"engine {lease.index} died")
        return as_engine_error(lease.index, err)

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.ensure_future(self._poll())

    async def _poll(self) -> None:
        """Mirror the router's live engines; fail the turns on an engine it drained or replaced since."""
        while True:
            with contextlib.suppress(Exception):  # a slow router: keep the last view
                self._set_fleet(await self.router.engine_view.remote())
            await asyncio.sleep(self.poll_s)

    def _set_fleet(self, fleet: dict[int, tuple[tuple[int, int], bool]]) -> None:
        self._fleet = {index: (tuple(gen), alive) for index, (gen, alive) in fleet.items()}
        for (index, generation), channel in list(self._channels.items()):
            if self._void(Lease(index, generation, None)):
                del self._channels[(index, generation)]
                channel.close()
