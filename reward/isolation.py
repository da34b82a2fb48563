"""`ProcessSlots`: run reward functions in subprocesses that are killed, not abandoned, on timeout.

Why: a thread running a runaway verifier (a sympy blow-up, an untrusted checker) cannot be stopped, and
CPU-heavy Python holds the GIL of the worker. Each slot is a one-process pool; a call takes a slot, and a
timeout (or a crash) kills that process and replaces the slot, leaving the other slots alone. Functions are
passed by name (registered or module:function) and resolved in the subprocess (spawned, not forked: the
parent is a threaded Ray worker), which first imports the run's user modules (`--import`), so rewards they
register are found there too.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from agentrl.plugins import load_user_modules
from agentrl.reward.registry import call_reward_sync
from agentrl.reward.types import FnOutput
from agentrl.types import Episode


class ProcessSlots:
    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.kills = 0
        self._ctx = multiprocessing.get_context("spawn")
        self._free: asyncio.Queue[ProcessPoolExecutor] | None = None
        self._all: set[ProcessPoolExecutor] = set()

    def _new(self) -> ProcessPoolExecutor:
        pool = ProcessPoolExecutor(max_workers=1, mp_context=self._ctx, initializer=load_user_modules)
        self._all.add(pool)
        return pool

    def _kill(self, pool: ProcessPoolExecutor) -> None:
        # ProcessPoolExecutor has no public kill; its worker processes are in _processes.
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.kill()
        pool.shutdown(wait=False, cancel_futures=True)
        self._all.discard(pool)

    async def run(self, name: str, episode: Episode, kwargs: dict[str, Any], timeout_s: float) -> FnOutput:
        if self._free is None:
            self._free = asyncio.Queue()
            for _ in range(self.slots):
                self._free.put_nowait(self._new())
        pool = await self._free.get()
        try:
            future = asyncio.get_running_loop().run_in_executor(pool, call_reward_sync, name, episode, kwargs)
            return await asyncio.wait_for(future, timeout_s)
        except (asyncio.TimeoutError, TimeoutError, BrokenProcessPool, asyncio.CancelledError):
            self.kills += 1
            self._kill(pool)
            pool = self._new()
            raise
        finally:
            self._free.put_nowait(pool)

    def close(self) -> None:
        for pool in list(self._all):
            self._kill(pool)
