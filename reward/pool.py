"""Reward workers: `RewardWorker` scores one episode with every configured function at once; `RewardPool`
spreads episodes over `num_workers` Ray actors with a bounded queue, timeouts and counters.

The rules: every function call has its own timeout (`functions[].timeout_s`) and the whole episode another
(`reward.timeout_s`, which also covers a dead or stuck worker). A function that fails or times out is
*missing*: its reason is in `RewardResult.missing`, it is counted in `stats()`, and the episode's score is None
so the caller can drop or retry it. Never a hang, never a silent zero.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import Any

from agentrl.config.schema import RewardConfig, RewardFnSpec
from agentrl.reward.isolation import ProcessSlots
from agentrl.reward.registry import call_reward, resolve
from agentrl.reward.types import FnOutput, RewardContext, RewardResult
from agentrl.types import Episode

THREADS_PER_WORKER = 64  # sync reward functions run in threads; sleeping/IO-bound ones overlap up to this


class MissingKind(str, Enum):
    """Why a reward function has no score; `RewardPool.stats()` counts missing calls by these values."""

    TIMEOUT = "timeout"
    ERROR = "error"


class Missing(str):
    """The reason a function has no score. It is its readable text ("timeout after 2s", "error: ValueError: ..."),
    so `RewardResult.missing` reads and compares as plain strings, and it carries its `kind` for the counters."""

    kind: MissingKind

    def __new__(cls, kind: MissingKind, text: str) -> Missing:
        self = super().__new__(cls, text)
        self.kind = kind
        return self

    def __reduce__(self) -> tuple[type, tuple[MissingKind, str]]:
        """Results cross Ray actors pickled; keep the kind (str's own reduce would rebuild it from the text)."""
        return type(self), (self.kind, str(self))


def _kind(reason: str) -> MissingKind:
    """A reason this module did not make (plain text) counts as an error."""
    return reason.kind if isinstance(reason, Missing) else MissingKind.ERROR


class RewardWorker:
    """Scores episodes; used as a Ray actor by `RewardPool`, or directly (no Ray) in tests and tools."""

    def __init__(self, cfg: RewardConfig, judge_router: Any = None) -> None:
        self.cfg = cfg
        self.fns = {spec.key: resolve(spec.name) for spec in cfg.functions}
        self.context = RewardContext(judge_router=judge_router)
        self.threads = ThreadPoolExecutor(THREADS_PER_WORKER, thread_name_prefix="reward")
        uses_processes = any(spec.isolation == "process" for spec in cfg.functions)
        self.processes = ProcessSlots(cfg.process_slots) if uses_processes else None

    async def _one(self, spec: RewardFnSpec, episode: Episode) -> FnOutput | Missing:
        """The function's output, or the reason it is missing."""
        try:
            if spec.isolation == "process" and self.processes is not None:
                return await self.processes.run(spec.name, episode, spec.kwargs, spec.timeout_s)
            call = call_reward(self.fns[spec.key], episode, spec.kwargs, self.context, spec.key, self.threads)
            return await asyncio.wait_for(call, spec.timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            return Missing(MissingKind.TIMEOUT, f"timeout after {spec.timeout_s:g}s")
        except Exception as err:
            return Missing(MissingKind.ERROR, f"error: {type(err).__name__}: {err}"[:500])

    async def score(self, episode: Episode) -> RewardResult:
        start = time.perf_counter()
        outputs = await asyncio.gather(*(self._one(spec, episode) for spec in self.cfg.functions))
        result = RewardResult(score=None, episode_id=episode.episode_id)
        total = 0.0
        for spec, out in zip(self.cfg.functions, outputs, strict=True):
            if isinstance(out, Missing):
                result.missing[spec.key] = out
                continue
            result.components[spec.key] = out.score
            result.metrics[f"reward/{spec.key}"] = out.score
            result.metrics.update({f"reward/{spec.key}/{k}": v for k, v in out.metrics.items()})
            total += spec.weight * out.score
        result.score = None if result.missing else total
        result.seconds = time.perf_counter() - start
        return result

    def stats(self) -> dict[str, Any]:
        return {"process_kills": self.processes.kills if self.processes else 0}

    def close(self) -> None:
        if self.processes is not None:
            self.processes.close()
        self.threads.shutdown(wait=False, cancel_futures=True)


class RewardPool:
    """`await pool.score(episode) -> RewardResult` over `cfg.num_workers` reward actors.

    Back-pressure: at most `cfg.queue_size` episodes are queued or in flight; `score` waits for room beyond
    that, which slows the producer (the env manager) instead of growing memory. Episodes go to the worker with
    the fewest in flight. `local=True` runs one in-process worker (no Ray): for tests and debugging.
    Make the pool inside the event loop that will call it (its semaphore belongs to that loop).
    """

    def __init__(self, cfg: RewardConfig, judge_router: Any = None, *, local: bool = False) -> None:
        self.cfg = cfg
        for spec in cfg.functions:  # fail here, naming the function, not inside a worker
            resolve(spec.name)
        if local:
            self._workers: list[Any] = [RewardWorker(cfg, judge_router)]
        else:
            import ray

            actor = ray.remote(RewardWorker).options(num_cpus=0, max_concurrency=cfg.queue_size + 8)
            self._workers = [actor.remote(cfg, judge_router) for _ in range(cfg.num_workers)]
        self.local = local
        self._load = [0] * len(self._workers)
        self._room: asyncio.Semaphore | None = None
        self._waiting = self._in_flight = self._scored = self._complete = 0
        self._missing_by_reason: Counter[str] = Counter()
        self._missing_by_fn: Counter[str] = Counter()
        self._seconds = 0.0

    async def score(self, episode: Episode) -> RewardResult:
        if not self.cfg.functions:
            return RewardResult(score=0.0, episode_id=episode.episode_id)
        if self._room is None:
            self._room = asyncio.Semaphore(self.cfg.queue_size)
        self._waiting += 1
        async with self._room:
            self._waiting -= 1
            self._in_flight += 1
            index = min(range(len(self._workers)), key=self._load.__getitem__)
            self._load[index] += 1
            start = time.perf_counter()
            try:
                result = await asyncio.wait_for(self._call(index, episode), self.cfg.timeout_s)
            except (asyncio.TimeoutError, TimeoutError):
                reason = Missing(MissingKind.TIMEOUT, f"timeout: episode not scored within {self.cfg.timeout_s:g}s")
                result = self._all_missing(episode, reason)
            except Exception as err:  # a dead worker, a pickling problem: still an answer, never a hang
                reason = Missing(MissingKind.ERROR, f"error: worker {index}: {type(err).__name__}: {err}"[:500])
                result = self._all_missing(episode, reason)
            finally:
                self._load[index] -= 1
                self._in_flight -= 1
            self._seconds += time.perf_counter() - start
        self._count(result)
        return result

    async def _call(self, index: int, episode: Episode) -> RewardResult:
        worker = self._workers[index]
        return await (worker.score(episode) if self.local else worker.score.remote(episode))

    def _all_missing(self, episode: Episode, reason: Missing) -> RewardResult:
        return RewardResult(None, missing={s.key: reason for s in self.cfg.functions}, episode_id=episode.episode_id)

    def _count(self, result: RewardResult) -> None:
        self._scored += 1
        self._complete += int(result.score is not None)
        for key, reason in result.missing.items():
            self._missing_by_fn[key] += 1
            self._missing_by_reason[_kind(reason).value] += 1

    @property
    def in_queue(self) -> int:
        """Episodes waiting for room plus those being scored."""
        return self._waiting + self._in_flight

    def stats(self) -> dict[str, Any]:
        """Counters since start: `scored` episodes, `complete` (no function missing), missing function calls
        by reason kind (timeout / error) and by function, queue depth, mean seconds per episode."""
        return {
            "scored": self._scored,
            "complete": self._complete,
            "incomplete": self._scored - self._complete,
            "missing_by_reason": dict(self._missing_by_reason),
            "missing_by_fn": dict(self._missing_by_fn),
            "in_queue": self.in_queue,
            "in_flight": self._in_flight,
            "mean_seconds": self._seconds / self._scored if self._scored else 0.0,
        }

    def shutdown(self) -> None:
        """Stop subprocesses and the worker actors. Idempotent."""
        if self.local:
            for worker in self._workers:
                worker.close()
        else:
            import ray

            try:
                ray.get([w.close.remote() for w in self._workers], timeout=10)
            except Exception:
                pass
            for worker in self._workers:
                ray.kill(worker)
        self._workers = []


def combine(env_return: float, result: RewardResult | None, cfg: RewardConfig) -> float | None:
    """The episode's return: env_reward_weight * env_return + weighted reward score; None if a reward is missing.

    With no reward functions configured (`result` None or no components) it is the weighted env return alone.
    """
    if result is None:
        return cfg.env_reward_weight * env_return
    if result.score is None:
        return None
    return cfg.env_reward_weight * env_return + result.score
