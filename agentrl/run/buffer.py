"""The async sample queue between rollout and training, with staleness bounded by admission control.

AReaL's rule, written once: an episode may start only while

    started_episodes + new <= (max_staleness + trainer_version + 1) * batch_episodes

Versions count trained batches (RL steps). Admission alone bounds when episodes *start*; a long episode could
still finish after younger ones and be trained too late. So batches are taken in admission order, and a group
admitted at version v is *due* at version v + max_staleness: the trainer waits for due groups still running (a
straggler holds training up only after max_staleness versions of slack; with partial rollout it runs on the new
weights meanwhile), and a batch takes every due group, even when that makes it larger than `batch_groups` (younger
groups that finished first may have filled earlier batches). So every token of every trained sample is at most
`max_staleness` versions old, and finished work is never thrown away for being slow.
max_staleness=0 is synchronous on-policy RL: the next batch cannot start until the trainer has produced the
version it will be sampled from, and each batch waits for all of its episodes.

The buffer is also the one ledger of admitted work: every admitted group is either running or ready (or was
handed to the trainer), and each move between those happens in one step on the event loop, so `state()` is a
consistent snapshot for checkpoints. A run that cannot make progress (nothing running, too few groups ready,
admission closed; or every episode of many groups in a row failed) raises RolloutStalled instead of hanging.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import time
from dataclasses import dataclass
from typing import Any

from agentrl.types import Group, Sample


class RolloutStalled(RuntimeError):
    """The run cannot make progress (no healthy engine, every episode failing, or a deadlocked buffer)."""


def admission_limit(max_staleness: int, trainer_version: int, batch_episodes: int) -> int:
    """Episodes that may have been started in total while the trainer is at `trainer_version`."""
    return (max_staleness + trainer_version + 1) * batch_episodes


@dataclass(frozen=True)
class Admission:
    """One admitted task group: what to re-run if the run stops before it comes back."""

    key: int  # admission order
    tag: str
    seed: int
    episodes: int
    version: int  # the trainer version when admitted; put() stamps it on the group as admitted_version


@dataclass
class BufferStats:
    """Running totals over every group that came back, trained or not: the one count of dropped work."""

    groups_filtered: int = 0  # dropped: no samples left, or equal returns under drop_zero_variance
    episodes_failed: int = 0  # the env or a tool crashed or timed out
    rewards_missing: int = 0  # a reward function failed or timed out
    rollout_blocked_s: float = 0.0  # time the producer waited on admission with nothing in flight

    def metrics_since(self, before: BufferStats, wall_s: float) -> dict[str, float]:
        """A step's share (since the copy `before`, over `wall_s` seconds), under the logged metric names."""
        return {
            "rollout/filtered_groups": float(self.groups_filtered - before.groups_filtered),
            "rollout/failed_episodes": float(self.episodes_failed - before.episodes_failed),
            "rollout/missing_rewards": float(self.rewards_missing - before.rewards_missing),
            "idle/rollout": (self.rollout_blocked_s - before.rollout_blocked_s) / wall_s,
        }


class SampleBuffer:
    """Groups in, batches out (earliest admitted first). Lives on the driver's event loop next to the producer."""

    def __init__(
        self,
        batch_groups: int,
        batch_episodes: int,
        max_staleness: int,
        drop_zero_variance: bool = False,
        stop_after_failed_groups: int = 0,
    ):
        self.batch_groups = batch_groups
        self.batch_episodes = batch_episodes
        self.max_staleness = max_staleness
        self.drop_zero_variance = drop_zero_variance
        self.stop_after_failed_groups = stop_after_failed_groups  # 0 = never stop for failing groups
        self.version = 0
        self.started = 0  # episodes admitted, less those given back by filtered groups
        self._next_key = 0
        self._running: dict[int, Admission] = {}
        # Counters over `_running`, so that admit/put and the trainer's wake-ups cost O(1) and not O(groups running):
        # with 10k+ episodes in flight a scan on every put is a quadratic term.
        self._in_flight = 0
        self._running_versions: collections.Counter[int] = collections.Counter()  # version -> groups running
        self._version_heap: list[int] = []  # those versions, oldest on top (entries at count 0 popped lazily)
        self._ready: list[Group] = []
        self._waiting_admission = 0  # episodes the producer is waiting to start
        self._failed_in_a_row = 0
        self._first_failure = ""
        self._stalled: str | None = None
        self._changed = asyncio.Condition()
        self.stats = BufferStats()

    @property
    def in_flight(self) -> int:
        """Episodes admitted and not yet put back."""
        return self._in_flight

    # ---- producer side ---------------------------------------------------------------------------------------
    def can_start(self, episodes: int) -> bool:
        return self.started + episodes <= admission_limit(self.max_staleness, self.version, self.batch_episodes)

    async def admit(self, tag: str, seed: int, episodes: int) -> Admission:
        """Wait until `episodes` more may start under the staleness bound, then record the group as running.
        The caller must start the group with no `await` in between, so a snapshot never misses it."""
        async with self._changed:
            t0 = time.perf_counter()
            idle = self.in_flight == 0
            self._waiting_admission = episodes
            self._changed.notify_all()  # a trainer waiting for a batch re-checks for a deadlock
            try:
                await self._changed.wait_for(lambda: self.can_start(episodes))
            finally:
                self._waiting_admission = 0
            if idle:
                self.stats.rollout_blocked_s += time.perf_counter() - t0
            self.started += episodes
            self._next_key += 1
            admission = Admission(self._next_key, tag, seed, episodes, self.version)
            self._running[admission.key] = admission
            self._in_flight += episodes
            if not self._running_versions[admission.version]:
                heapq.heappush(self._version_heap, admission.version)
            self._running_versions[admission.version] += 1
            return admission

    async def put(self, admission: Admission, group: Group) -> None:
        """A group came back: it moves from running to ready (or is counted and dropped) in one step."""
        async with self._changed:
            del self._running[admission.key]
            self._in_flight -= admission.episodes
            self._running_versions[admission.version] -= 1
            if not self._running_versions[admission.version]:
                del self._running_versions[admission.version]
            group.admitted_version = admission.version
            self.stats.episodes_failed += len(group.failures)
            self.stats.rewards_missing += len(group.missing_rewards)
            self._count_failures(group, admission.episodes)
            keep = bool(group.samples)
            if keep and self.drop_zero_variance:
                returns = {s.episode_id: s.reward for s in group.samples}
                keep = len(set(returns.values())) > 1
            if keep:
                self._ready.append(group)
            else:
                # Filtered or empty: give its admission back so a replacement group can start.
                self.stats.groups_filtered += 1
                self.started -= admission.episodes
            self._changed.notify_all()

    def _count_failures(self, group: Group, episodes: int) -> None:
        """Stop the run once every episode of `stop_after_failed_groups` groups in a row failed."""
        if not group.failures or len(group.failures) < episodes:
            self._failed_in_a_row = 0
            return
        if self._failed_in_a_row == 0:
            self._first_failure = str(group.failures[0])
        self._failed_in_a_row += 1
        # The first reason to stop is kept: failures landing before the trainer sees it must not reword it.
        if self.stop_after_failed_groups and self._failed_in_a_row >= self.stop_after_failed_groups:
            self._stalled = self._stalled or (
                f"every episode of the last {self._failed_in_a_row} groups failed; the first: {self._first_failure}"
            )

    async def stall(self, reason: str) -> None:
        """Make the trainer's next (or current) wait for a batch raise RolloutStalled(reason)."""
        async with self._changed:
            self._stalled = reason
            self._changed.notify_all()

    # ---- trainer side ----------------------------------------------------------------------------------------
    def _due_running(self) -> bool:
        """A group that must be trained in this batch (admitted max_staleness versions ago) is still running."""
        heap = self._version_heap
        while heap and not self._running_versions.get(heap[0]):
            heapq.heappop(heap)
        return bool(heap) and heap[0] <= self.version - self.max_staleness

    def _deadlocked(self) -> bool:
        """Nothing running, too few groups ready, and the producer cannot start more: no one can move."""
        return (
            not self._running
            and len(self._ready) < self.batch_groups
            and self._waiting_admission > 0
            and not self.can_start(self._waiting_admission)
        )

    async def get_batch(self) -> list[Group]:
        """`batch_groups` finished groups, earliest admitted first, once no due group is still running; more when
        more groups are due."""
        async with self._changed:
            await self._changed.wait_for(
                lambda: (
                    self._stalled is not None
                    or self._deadlocked()
                    or (len(self._ready) >= self.batch_groups and not self._due_running())
                )
            )
            if self._stalled is not None:
                raise RolloutStalled(self._stalled)
            if self._deadlocked():
                raise RolloutStalled(
                    f"buffer deadlock: {len(self._ready)} of {self.batch_groups} groups ready, none running, and "
                    f"admission closed ({self.started} episodes started, limit "
                    f"{admission_limit(self.max_staleness, self.version, self.batch_episodes)} at version "
                    f"{self.version})"
                )
            self._ready.sort(key=lambda g: g.admitted_version)  # stable: arrival order within a version
            due = sum(1 for g in self._ready if g.admitted_version <= self.version - self.max_staleness)
            n = max(self.batch_groups, due)
            batch, self._ready = self._ready[:n], self._ready[n:]
            return batch

    async def set_version(self, version: int) -> None:
        async with self._changed:
            self.version = version
            self._changed.notify_all()

    # ---- checkpointing ---------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """A snapshot of the ledger: finished groups still queued, the groups still running (re-run on resume, in
        admission order) and the admission counters without them. Synchronous, so it is one instant."""
        running = sorted(self._running.values(), key=lambda a: a.key)
        return {
            "ready": list(self._ready),
            "running": [(a.tag, a.seed) for a in running],
            "started": self.started - self.in_flight,
            "version": self.version,
        }

    def load_state(self, state: dict[str, Any]) -> list[tuple[str, int]]:
        """Restore a snapshot; returns the groups that were running, for the producer to start again."""
        self._ready = list(state["ready"])
        self.started = state["started"]
        self.version = state["version"]
        return list(state["running"])


def staleness(samples: list[Sample], trainer_version: int) -> list[int]:
    """Versions between the policy being trained and the oldest token of each sample."""
    return [trainer_version - min(s.policy_versions, default=trainer_version) for s in samples]
