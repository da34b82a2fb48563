"""The async benchmark's model of the buffer's rules: it is what says how far the exact staleness bound lets the
async speed-up go on the LongTail workload, so it must reproduce the synchronous case exactly."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_async_vs_sync as bench

from agentrl.envs.long_tail import episode_plan


def test_model_of_sync_rl_waits_for_the_slowest_group_of_every_batch() -> None:
    steps, llm_s, step_s = 6, 0.1, 0.4
    groups = bench.GROUPS_PER_BATCH
    wall = 0.0
    for batch in range(1, steps):  # batch 0 is the warm-up step, not counted
        seeds = range(batch * groups, (batch + 1) * groups)
        plans = [episode_plan(s, **bench.LONG_TAIL) for s in seeds]
        wall += max(sum(p) + len(p) * llm_s for p in plans) + step_s
    expected = (steps - 1) * groups * bench.GROUP_SIZE / wall
    assert abs(bench.modelled_samples_per_s(0, steps, llm_s, step_s) - expected) < 1e-9


def test_model_gains_from_slack_but_stays_under_the_unbounded_ideal() -> None:
    rates = [bench.modelled_samples_per_s(k, 30, 0.1, 0.4) for k in (0, 1, 4, 8)]
    assert rates == sorted(rates) and rates[0] < rates[1]
    # without the bound the trainer would never wait: one batch per step_s at most
    assert rates[-1] < bench.GROUPS_PER_BATCH * bench.GROUP_SIZE / 0.4
