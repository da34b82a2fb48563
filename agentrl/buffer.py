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
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from agentrl.types import Group, Sample


def admission_limit(max_staleness: int, trainer_version: int, batch_episodes: int) -> int:
    """Episodes that may have been started in total while the trainer is at `trainer_version`."""
    return (max_staleness + trainer_version + 1) * batch_episodes


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
        start_version: int = 0,
        started_episodes: int | None = None,
    ):
        self.batch_groups = batch_groups
        self.batch_episodes = batch_episodes
        self.max_staleness = max_staleness
        self.drop_zero_variance = drop_zero_variance
        self.version = start_version
        # On resume, count the batches already consumed as started so the formula stays the same.
        self.started = start_version * batch_episodes if started_episodes is None else started_episodes
        self._running: Counter[int] = Counter()  # admission version -> episodes still running
        self._ready: list[Group] = []
        self._changed = asyncio.Condition()
        self.stats = BufferStats()

    @property
    def in_flight(self) -> int:
        """Episodes admitted and not yet put back."""
        return sum(self._running.values())

    # ---- producer side ---------------------------------------------------------------------------------------
    def can_start(self, episodes: int) -> bool:
        return self.started + episodes <= admission_limit(self.max_staleness, self.version, self.batch_episodes)

    async def admit(self, episodes: int) -> int:
        """Wait until `episodes` more may start under the staleness bound, count them as started, and return the
        admission version (put() the finished group with it as `admitted_version`)."""
        async with self._changed:
            t0 = time.perf_counter()
            idle = self.in_flight == 0
            await self._changed.wait_for(lambda: self.can_start(episodes))
            if idle:
                self.stats.rollout_blocked_s += time.perf_counter() - t0
            self.started += episodes
            self._running[self.version] += episodes
            return self.version

    async def put(self, group: Group, planned_episodes: int) -> None:
        async with self._changed:
            self._running[group.admitted_version] -= planned_episodes
            if self._running[group.admitted_version] <= 0:
                del self._running[group.admitted_version]
            self.stats.episodes_failed += len(group.failures)
            self.stats.rewards_missing += len(group.missing_rewards)
            keep = bool(group.samples)
            if keep and self.drop_zero_variance:
                returns = {s.episode_id: s.reward for s in group.samples}
                keep = len(set(returns.values())) > 1
            if keep:
                self._ready.append(group)
            else:
                # Filtered or empty: give its admission back so a replacement group can start.
                self.stats.groups_filtered += 1
                self.started -= planned_episodes
            self._changed.notify_all()

    # ---- trainer side ----------------------------------------------------------------------------------------
    def _due_running(self) -> bool:
        """A group that must be trained in this batch (admitted max_staleness versions ago) is still running."""
        return any(v <= self.version - self.max_staleness for v in self._running)

    async def get_batch(self) -> list[Group]:
        """`batch_groups` finished groups, earliest admitted first, once no due group is still running; more when
        more groups are due."""
        async with self._changed:
            await self._changed.wait_for(lambda: len(self._ready) >= self.batch_groups and not self._due_running())
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
        """Finished groups still queued and the admission counters (in-flight groups are re-run on resume)."""
        return {"ready": list(self._ready), "started": self.started - self.in_flight, "version": self.version}

    def load_state(self, state: dict[str, Any]) -> None:
        self._ready = list(state["ready"])
        self.started = state["started"]
        self.version = state["version"]


def staleness(samples: list[Sample], trainer_version: int) -> list[int]:
    """Versions between the policy being trained and the oldest token of each sample."""
    return [trainer_version - min(s.policy_versions, default=trainer_version) for s in samples]
