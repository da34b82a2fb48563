"""SampleBuffer: admission control, batches in admission order, and due stragglers holding the trainer back, so
that no trained sample is older than max_staleness versions however long its episode ran."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.run.buffer import Admission, RolloutStalled, SampleBuffer
from agentrl.types import EpisodeFailure, Group, Sample


def _group(seed: int, size: int = 2) -> Group:
    samples = [Sample([1, 2], [0, 1], [0.0, -1.0], [0] * 2, float(i), f"g{seed}", f"e{seed}/{i}") for i in range(size)]
    return Group(tag="t", seed=seed, split="train", samples=samples)


class Producer:
    """Admits groups with seeds 0, 1, 2, ... in order and puts them back by seed."""

    def __init__(self, buf: SampleBuffer):
        self.buf = buf
        self.admitted: dict[int, Admission] = {}
        self.seeds = 0

    async def admit(self, n: int) -> list[int]:
        """Admit n groups of 2 episodes; their admission versions."""
        versions = []
        for _ in range(n):
            admission = await asyncio.wait_for(self.buf.admit("t", self.seeds, 2), 1)
            self.admitted[self.seeds] = admission
            self.seeds += 1
            versions.append(admission.version)
        return versions

    async def put(self, seed: int, group: Group | None = None) -> None:
        await self.buf.put(self.admitted.pop(seed), group or _group(seed))


async def test_admission_limit_and_back_pressure() -> None:
    buf = SampleBuffer(batch_groups=2, batch_episodes=4, max_staleness=1)
    run = Producer(buf)
    assert await run.admit(4) == [0, 0, 0, 0]  # (1 + 0 + 1) x 4 episodes
    blocked = asyncio.ensure_future(buf.admit("t", 9, 2))
    await asyncio.sleep(0.05)
    assert not blocked.done()
    await buf.set_version(1)
    assert (await asyncio.wait_for(blocked, 1)).version == 1


async def test_a_straggler_is_trained_before_it_gets_too_stale() -> None:
    """Group 0 (admitted at v0) finishes last. With max_staleness 1 it may wait out batch v0, but batch v1 must
    include it: the trainer waits for it rather than train younger groups first."""
    buf = SampleBuffer(batch_groups=2, batch_episodes=4, max_staleness=1)
    run = Producer(buf)
    await run.admit(4)
    for seed in (1, 2, 3):
        await run.put(seed)
    first = await asyncio.wait_for(buf.get_batch(), 1)  # v0: group 0 not due yet
    assert [g.seed for g in first] == [1, 2]
    await buf.set_version(1)
    assert await run.admit(2) == [1, 1]
    await run.put(4)
    await run.put(5)
    waiting = asyncio.ensure_future(buf.get_batch())
    await asyncio.sleep(0.05)
    assert not waiting.done(), "three groups are ready but the due straggler is still running"
    await run.put(0)
    second = await asyncio.wait_for(waiting, 1)
    assert [g.seed for g in second] == [3, 0]  # earliest admitted first, the straggler included
    assert all(1 - g.admitted_version <= 1 for g in second)


async def test_a_batch_takes_every_due_group_even_beyond_its_size() -> None:
    """max_staleness 2, batches of 2 groups: groups 0-3 (v0) run long while younger ones fill batches v0 and v1.
    At v2 all four are due: the batch takes all four rather than leave two to be trained 3 versions late."""
    buf = SampleBuffer(batch_groups=2, batch_episodes=4, max_staleness=2)
    run = Producer(buf)
    assert await run.admit(6) == [0] * 6
    for seed in (4, 5):
        await run.put(seed)
    assert [g.seed for g in await asyncio.wait_for(buf.get_batch(), 1)] == [4, 5]
    await buf.set_version(1)
    assert await run.admit(2) == [1, 1]
    for seed in (6, 7):
        await run.put(seed)
    assert [g.seed for g in await asyncio.wait_for(buf.get_batch(), 1)] == [6, 7]  # nothing due yet at v1
    await buf.set_version(2)
    waiting = asyncio.ensure_future(buf.get_batch())
    for seed in (0, 1, 2, 3):
        await asyncio.sleep(0.01)
        assert not waiting.done()
        await run.put(seed)
    assert [g.seed for g in await asyncio.wait_for(waiting, 1)] == [0, 1, 2, 3]


async def test_sync_mode_waits_for_the_whole_batch_and_filtered_groups_free_admission() -> None:
    buf = SampleBuffer(batch_groups=2, batch_episodes=4, max_staleness=0, drop_zero_variance=True)
    run = Producer(buf)
    await run.admit(2)
    flat = _group(0)
    for s in flat.samples:
        s.reward = 1.0
    await run.put(0, flat)  # zero variance: dropped, its admission is given back
    assert buf.stats.groups_filtered == 1 and await run.admit(1) == [0]
    await run.put(1)
    waiting = asyncio.ensure_future(buf.get_batch())
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await run.put(2)
    assert [g.seed for g in await asyncio.wait_for(waiting, 1)] == [1, 2]


@pytest.mark.parametrize("k", [0, 1, 2])
async def test_random_finish_order_never_exceeds_the_bound(k: int) -> None:
    """A simulated run: groups finish in random order; every trained group is at most k versions old."""
    import random

    rng = random.Random(k)
    buf = SampleBuffer(batch_groups=4, batch_episodes=8, max_staleness=k)
    worst = 0
    finishing: set[asyncio.Future] = set()

    async def producer() -> None:
        seed = 0
        while True:
            admission = await buf.admit("t", seed, 2)
            seed += 1

            async def finish(a: Admission = admission) -> None:
                await asyncio.sleep(rng.choice([0.001, 0.002, 0.02]))
                await buf.put(a, _group(a.seed))

            finishing.add(asyncio.ensure_future(finish()))

    prod = asyncio.ensure_future(producer())
    try:
        for step in range(12):
            batch = await asyncio.wait_for(buf.get_batch(), 5)
            worst = max(worst, max(step - g.admitted_version for g in batch))
            await asyncio.sleep(0.003)
            await buf.set_version(step + 1)
    finally:
        prod.cancel()
    assert worst <= k


async def test_snapshot_sees_each_group_in_exactly_one_place_and_restores_the_running_ones() -> None:
    buf = SampleBuffer(batch_groups=2, batch_episodes=4, max_staleness=1)
    run = Producer(buf)
    await run.admit(4)
    await run.put(2)
    await run.put(0)
    state = buf.state()
    assert [g.seed for g in state["ready"]] == [2, 0]
    assert state["running"] == [("t", 1), ("t", 3)]  # in admission order, re-run on resume
    assert state["started"] == 4  # the running groups are admitted again when they restart
    fresh = SampleBuffer(batch_groups=2, batch_episodes=4, max_staleness=1)
    assert fresh.load_state(state) == [("t", 1), ("t", 3)]
    assert fresh.started == 4 and fresh.in_flight == 0 and fresh.can_start(4) and not fresh.can_start(6)


async def test_a_deadlocked_buffer_raises_instead_of_hanging() -> None:
    """A defect in the admission counters (here: a restored `started` that counts groups twice) leaves nothing
    running, too few groups ready and admission closed; the trainer's wait fails with the counters."""
    buf = SampleBuffer(batch_groups=2, batch_episodes=4, max_staleness=0)
    buf.load_state({"ready": [], "running": [], "started": 4, "version": 0})
    producer = asyncio.ensure_future(buf.admit("t", 0, 2))
    with pytest.raises(RolloutStalled, match="buffer deadlock: 0 of 2 groups ready, none running"):
        await asyncio.wait_for(buf.get_batch(), 1)
    producer.cancel()


async def test_every_episode_failing_in_consecutive_groups_stops_with_the_first_message() -> None:
    buf = SampleBuffer(batch_groups=2, batch_episodes=4, max_staleness=0, stop_after_failed_groups=3)
    run = Producer(buf)
    waiting = asyncio.ensure_future(buf.get_batch())
    for i in range(3):
        await run.admit(1)
        # one of two episodes failed: no stop
        half = Group(tag="t", seed=i, failures=[EpisodeFailure("e0", "env crashed")])
        full = Group(tag="t", seed=i, failures=[EpisodeFailure(f"e{i}/{k}", f"boom {i}") for k in range(2)])
        await run.put(i, half if i == 0 else full)
    assert not waiting.done() and buf.stats.episodes_failed == 5
    await run.admit(1)
    await run.put(3, Group(tag="t", seed=3, failures=[EpisodeFailure(f"e3/{k}", "boom 3") for k in range(2)]))
    with pytest.raises(RolloutStalled, match="every episode of the last 3 groups failed; the first: e1/0: boom 1"):
        await asyncio.wait_for(waiting, 1)


async def test_failures_landing_after_the_stop_keep_its_message() -> None:
    """Groups that fail between the stop and the trainer's wake-up must not reword the reason (CI saw "last 4")."""
    buf = SampleBuffer(batch_groups=2, batch_episodes=4, max_staleness=0, stop_after_failed_groups=2)
    run = Producer(buf)
    for i in range(3):
        await run.admit(1)
        await run.put(i, Group(tag="t", seed=i, failures=[EpisodeFailure(f"e{i}/{k}", "boom") for k in range(2)]))
    with pytest.raises(RolloutStalled, match="every episode of the last 2 groups failed; the first: e0/0: boom"):
        await asyncio.wait_for(buf.get_batch(), 1)


async def test_stall_wakes_a_waiting_trainer() -> None:
    buf = SampleBuffer(batch_groups=2, batch_episodes=4, max_staleness=0)
    waiting = asyncio.ensure_future(buf.get_batch())
    await asyncio.sleep(0)  # one turn of the loop: the trainer is now waiting on the buffer
    assert not waiting.done()
    await buf.stall("no healthy rollout engine for 61 s")
    with pytest.raises(RolloutStalled, match="no healthy rollout engine"):
        await asyncio.wait_for(waiting, 1)
