"""SampleBuffer: admission control, batches in admission order, and due stragglers holding the trainer back, so
that no trained sample is older than max_staleness versions however long its episode ran."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.buffer import SampleBuffer
from agentrl.types import Group, Sample


def _group(seed: int, version: int, size: int = 2) -> Group:
    samples = [
        Sample([1, 2], [0, 1], [0.0, -1.0], [version] * 2, float(i), f"g{seed}", f"e{seed}/{i}") for i in range(size)
    ]
    return Group(tag="t", seed=seed, split="train", samples=samples, admitted_version=version)


async def _admit_all(buf: SampleBuffer, n: int) -> list[int]:
    return [await asyncio.wait_for(buf.admit(2), 1) for _ in range(n)]


async def test_admission_limit_and_back_pressure() -> None:
    buf = SampleBuffer(batch_groups=2, batch_episodes=4, max_staleness=1)
    assert await _admit_all(buf, 4) == [0, 0, 0, 0]  # (1 + 0 + 1) x 4 episodes
    blocked = asyncio.ensure_future(buf.admit(2))
    await asyncio.sleep(0.05)
    assert not blocked.done()
    await buf.set_version(1)
    assert await asyncio.wait_for(blocked, 1) == 1


async def test_a_straggler_is_trained_before_it_gets_too_stale() -> None:
    """Group 0 (admitted at v0) finishes last. With max_staleness 1 it may wait out batch v0, but batch v1 must
    include it: the trainer waits for it rather than train younger groups first."""
    buf = SampleBuffer(batch_groups=2, batch_episodes=4, max_staleness=1)
    await _admit_all(buf, 4)
    for seed in (1, 2, 3):
        await buf.put(_group(seed, 0), 2)
    first = await asyncio.wait_for(buf.get_batch(), 1)  # v0: group 0 not due yet
    assert [g.seed for g in first] == [1, 2]
    await buf.set_version(1)
    assert await _admit_all(buf, 2) == [1, 1]
    await buf.put(_group(4, 1), 2)
    await buf.put(_group(5, 1), 2)
    waiting = asyncio.ensure_future(buf.get_batch())
    await asyncio.sleep(0.05)
    assert not waiting.done(), "three groups are ready but the due straggler is still running"
    await buf.put(_group(0, 0), 2)
    second = await asyncio.wait_for(waiting, 1)
    assert [g.seed for g in second] == [3, 0]  # earliest admitted first, the straggler included
    assert all(1 - g.admitted_version <= 1 for g in second)


async def test_a_batch_takes_every_due_group_even_beyond_its_size() -> None:
    """max_staleness 2, batches of 2 groups: groups 0-3 (v0) run long while younger ones fill batches v0 and v1.
    At v2 all four are due: the batch takes all four rather than leave two to be trained 3 versions late."""
    buf = SampleBuffer(batch_groups=2, batch_episodes=4, max_staleness=2)
    assert await _admit_all(buf, 6) == [0] * 6
    for seed in (4, 5):
        await buf.put(_group(seed, 0), 2)
    assert [g.seed for g in await asyncio.wait_for(buf.get_batch(), 1)] == [4, 5]
    await buf.set_version(1)
    assert await _admit_all(buf, 2) == [1, 1]
    for seed in (6, 7):
        await buf.put(_group(seed, 1), 2)
    assert [g.seed for g in await asyncio.wait_for(buf.get_batch(), 1)] == [6, 7]  # nothing due yet at v1
    await buf.set_version(2)
    waiting = asyncio.ensure_future(buf.get_batch())
    for seed in (0, 1, 2, 3):
        await asyncio.sleep(0.01)
        assert not waiting.done()
        await buf.put(_group(seed, 0), 2)
    assert [g.seed for g in await asyncio.wait_for(waiting, 1)] == [0, 1, 2, 3]


async def test_sync_mode_waits_for_the_whole_batch_and_filtered_groups_free_admission() -> None:
    buf = SampleBuffer(batch_groups=2, batch_episodes=4, max_staleness=0, drop_zero_variance=True)
    await _admit_all(buf, 2)
    flat = _group(7, 0)
    for s in flat.samples:
        s.reward = 1.0
    await buf.put(flat, 2)  # zero variance: dropped, its admission is given back
    assert buf.stats.groups_filtered == 1 and await _admit_all(buf, 1) == [0]
    await buf.put(_group(1, 0), 2)
    waiting = asyncio.ensure_future(buf.get_batch())
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await buf.put(_group(2, 0), 2)
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
            v = await buf.admit(2)
            seed += 1

            async def finish(s: int = seed, v: int = v) -> None:
                await asyncio.sleep(rng.choice([0.001, 0.002, 0.02]))
                await buf.put(_group(s, v), 2)

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
