"""The env managers' path to the engines: one Ray call per model turn, straight to the episode's engine.

The router places each episode once (`Router.lease`: sticky, least-loaded) and keeps health, drain, restarts and
weight updates; the turns then go from the env manager to that engine directly, instead of through the router
(two Ray hops per turn, and the router's process busy with every token list: a third of the platform's CPU per
turn on a 2-core machine). Faults keep the router's rules:

- a dead actor or core found by a call is reported to the router (`report_death`), which drains and restarts
  it like one its own health loop found; the call fails with RetryableEngineError, and the retry is placed anew;
- the client polls the router's view of the fleet (`engine_view`, every `poll_s`): a call to an engine that was
  drained meanwhile (stuck, failed health checks, replaced) fails with RetryableEngineError at once, never hangs;
- a call still running after `request_timeout_s` fails with RetryableEngineError, as through the router.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from agentrl.config.schema import SamplingConfig
from agentrl.rollout.base import Lease, RetryableEngineError
from agentrl.rollout.router import as_engine_error, is_engine_death, short_error
from agentrl.types import GenOutput


class EngineClient:
    def __init__(self, router: Any, *, request_timeout_s: float = 300.0, poll_s: float = 0.25):
        self.router = router
        self.request_timeout_s = request_timeout_s
        self.poll_s = poll_s
        self._leases: dict[str, Lease] = {}
        self._fleet: dict[int, tuple[tuple[int, int], bool]] = {}  # index -> (generation, alive), as last polled
        self._pending: dict[tuple[int, tuple[int, int]], set[asyncio.Future]] = {}
        self._poller: asyncio.Task | None = None

    async def generate(self, episode_id: str, token_ids: list[int], sampling: SamplingConfig, rid: str) -> GenOutput:
        self._ensure_poller()
        lease = await self._lease(episode_id)
        key = (lease.index, lease.generation)
        fut = asyncio.ensure_future(self._call(lease, token_ids, sampling, rid))
        self._pending.setdefault(key, set()).add(fut)
        try:
            out = await asyncio.wait_for(fut, self.request_timeout_s)
        except asyncio.CancelledError:
            if self._void(lease):
                self._leases.pop(episode_id, None)
                raise RetryableEngineError(f"engine {lease.index} was drained") from None
            raise
        except TimeoutError:
            raise RetryableEngineError(f"engine {lease.index}: request {rid} timed out") from None
        except RetryableEngineError:
            self._leases.pop(episode_id, None)
            raise
        finally:
            pending = self._pending.get(key)
            if pending is not None:
                pending.discard(fut)
                if not pending:
                    del self._pending[key]
        out.engine = lease.index
        return out

    def release(self, episode_id: str) -> None:
        """The episode is over: forget its engine here and at the router."""
        self._leases.pop(episode_id, None)
        self.router.release.remote(episode_id)

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._poller

    # ---- internals -------------------------------------------------------------------------------------------
    async def _lease(self, episode_id: str) -> Lease:
        lease = self._leases.get(episode_id)
        if lease is None or self._void(lease):
            lease = await self.router.lease.remote(episode_id)
            self._leases[episode_id] = lease
        return lease

    def _void(self, lease: Lease) -> bool:
        """Whether the last poll saw the lease's engine drained or replaced. A lease newer than the poll (made
        after it) stands until the next one."""
        seen = self._fleet.get(lease.index)
        if seen is None or lease.generation > seen[0]:
            return False
        generation, alive = seen
        return not alive or generation != lease.generation

    async def _call(self, lease: Lease, token_ids: list[int], sampling: SamplingConfig, rid: str) -> GenOutput:
        try:
            return await lease.handle.generate.remote(token_ids, sampling, rid)
        except Exception as err:
            if is_engine_death(err):
                self._fleet[lease.index] = (lease.generation, False)
                self.router.report_death.remote(lease.index, lease.generation, short_error(err))
                raise RetryableEngineError(f"engine {lease.index} died") from err
            raise as_engine_error(lease.index, err) from err

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.ensure_future(self._poll())

    async def _poll(self) -> None:
        """Mirror the router's live engines; fail the calls to an engine it drained or replaced since."""
        while True:
            with contextlib.suppress(Exception):  # a slow router: keep the last view
                self._set_fleet(await self.router.engine_view.remote())
            await asyncio.sleep(self.poll_s)

    def _set_fleet(self, fleet: dict[int, tuple[tuple[int, int], bool]]) -> None:
        self._fleet = {index: (tuple(gen), alive) for index, (gen, alive) in fleet.items()}
        for (index, generation), futures in list(self._pending.items()):
            if self._void(Lease(index, generation, None)):
                for fut in futures:
                    fut.cancel()
