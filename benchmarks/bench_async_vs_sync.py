"""Fully async + partial rollout vs synchronous RL on a long-tail workload, same model and cores, in one run.

The workload (agentrl/LongTail-v0) has very uneven episode lengths and heavy-tailed step latency, so a
synchronous batch waits for its slowest episode. Prints JSON: trained samples/s of each mode (steps after the
first) over `--repeats` interleaved rounds, the median of the per-round ratios, the async runs' staleness maxima,
and, for the median round, trainer/rollout idle fractions, stage times and two bounds on the ratio:
- ideal_ratio_from_sync_stages: (rollout + train + sync) / (train + sync), rollout fully hidden. It ignores the
  staleness bound, so no bounded run can reach it.
- bound_ceiling_ratio: a discrete-event model of the buffer's rules on the workload's own seeded episodes, with the
  sync run's stage costs in both modes (`modelled_samples_per_s`; its sync number is printed beside the measured
  one as a check). A group admitted at version v must be trained by v + max_staleness, so an episode whose env
  latency outlasts max_staleness RL steps holds the trainer unless finished work is thrown away: this is the most
  the exact per-token bound allows here (for tasks started in the run's order).
The default 30 steps reach the steady state; the first ~8 are dominated by every group starting at once.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import tempfile
from pathlib import Path
from statistics import mean, median, median_low

import ray

from agentrl.config import load_config
from agentrl.envs.long_tail import episode_plan
from agentrl.observe.metrics import read_jsonl
from agentrl.run.buffer import admission_limit
from agentrl.run.loop import Pipeline
from agentrl.run.parts import start_parts

LONG_TAIL = {"median_turns": 2.0, "turns_sigma": 1.0, "max_steps": 12, "latency_s": 0.05, "latency_tail": 1.2}
GROUP_SIZE, GROUPS_PER_BATCH = 4, 4
WORKLOAD = [
    f"envs.train={{lt: {{env_id: agentrl/LongTail-v0, max_turns: 12, group_size: {GROUP_SIZE},"
    f" groups_per_batch: {GROUPS_PER_BATCH}, kwargs: {json.dumps(LONG_TAIL)}}}}}",
    "envs.val={}",
    "envs.env_threads=64",
    "rollout.sampling.max_tokens=16",
    "trainer.sft.enabled=false",
    "validation.every_steps=0",
    "logging.console=false",
    "logging.tensorboard=false",
]
MODES = {
    "sync": ["async.max_staleness=0", "async.partial_rollout=false"],
    "async_partial": ["async.partial_rollout=true"],  # + async.max_staleness from --max-staleness
}


async def run_mode(mode: str, steps: int, root: Path, max_staleness: int) -> dict[str, float]:
    staleness = [] if mode == "sync" else [f"async.max_staleness={max_staleness}"]
    overrides = [*WORKLOAD, *MODES[mode], *staleness, f"trainer.total_steps={steps}", f"name=bench_{mode}"]
    cfg = load_config(None, overrides)
    parts = start_parts(cfg, root / mode)
    pipeline = Pipeline(cfg, root / mode, parts)
    try:
        await pipeline.run(resume_from=None)
    finally:
        pipeline.close()
        parts.close()
    rows = [r for r in read_jsonl(root / mode / "metrics.jsonl") if "train/loss" in r]
    timed = rows[1:]  # the first step includes warm-up
    wall = timed[-1]["time"] - rows[0]["time"]
    return {
        "samples_per_s": sum(r["train/samples"] for r in timed) / wall,
        "step_s": mean(r["timing/step"] for r in timed),
        "idle_trainer": mean(r["idle/trainer"] for r in timed),
        "idle_rollout": mean(r["idle/rollout"] for r in timed),
        "rollout_s": mean(r["timing/rollout"] for r in timed),
        "train_s": mean(r["timing/train"] for r in timed),
        "weight_sync_s": mean(r["timing/weight_sync"] for r in timed),
        "staleness_max": max(r.get("staleness/max", 0.0) for r in timed),
        "partial_ratio": mean(r.get("partial/ratio", 0.0) for r in timed),
        "llm_s_per_turn": mean(r["timing/episode_llm"] / r["episode/turns"] for r in timed),
    }


def ideal_ratio(sync: dict[str, float]) -> float:
    """The speed-up if rollout were fully hidden behind training: (rollout + train + sync) / (train + sync)."""
    return (sync["rollout_s"] + sync["train_s"] + sync["weight_sync_s"]) / (sync["train_s"] + sync["weight_sync_s"])


def modelled_samples_per_s(max_staleness: int, steps: int, llm_s_per_turn: float, step_s: float) -> float:
    """Trained samples/s of a discrete-event model of the buffer's two rules (the admission limit, and a batch waits
    for its due groups) on this workload's own seeded episodes (group seeds 0, 1, ... in admission order), a turn
    costing `llm_s_per_turn` plus the env's latency and an RL step `step_s`, counted as `run_mode` counts. With
    the sync run's stage costs in both modes it is the speed-up the exact per-token bound leaves possible here:
    a straggler admitted at version v holds the trainer at v + max_staleness unless it is thrown away."""
    batch_episodes = GROUP_SIZE * GROUPS_PER_BATCH
    now, version, started, seed = 0.0, 0, 0, 0
    running: list[tuple[float, int]] = []  # (finish time, admitted version) of running groups
    ready: list[int] = []  # admitted versions of finished groups
    first_step_end, trained = 0.0, 0
    while version < steps:
        while started + GROUP_SIZE <= admission_limit(max_staleness, version, batch_episodes):
            plan = episode_plan(seed, **LONG_TAIL)
            heapq.heappush(running, (now + sum(plan) + len(plan) * llm_s_per_turn, version))
            started, seed = started + GROUP_SIZE, seed + 1
        due_running = any(v <= version - max_staleness for _, v in running)
        if len(ready) >= GROUPS_PER_BATCH and not due_running:
            ready.sort()
            n = max(GROUPS_PER_BATCH, sum(1 for v in ready if v <= version - max_staleness))
            ready, now, version = ready[n:], now + step_s, version + 1
            if version == 1:
                first_step_end = now
            else:
                trained += n * GROUP_SIZE
            while running and running[0][0] <= now:
                ready.append(heapq.heappop(running)[1])
        else:
            finish, v = heapq.heappop(running)
            now = max(now, finish)
            ready.append(v)
    return trained / (now - first_step_end)


async def main(steps: int, max_staleness: int, repeats: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix="agentrl-bench-"))
    rounds = []
    for i in range(repeats):  # interleaved: a load change on the machine hits both modes alike
        rounds.append({mode: await run_mode(mode, steps, root / f"round{i}", max_staleness) for mode in MODES})
    ratios = [r["async_partial"]["samples_per_s"] / r["sync"]["samples_per_s"] for r in rounds]
    mid = rounds[ratios.index(median_low(ratios))]  # the round whose ratio is the median: its stage times
    sync, asyn = mid["sync"], mid["async_partial"]
    model = {  # (llm s per turn, RL step s) -> modelled samples/s
        name: modelled_samples_per_s(k, steps, r["llm_s_per_turn"], r["train_s"] + r["weight_sync_s"])
        for name, k, r in (("sync", 0, sync), ("async_at_sync_costs", max_staleness, sync),
                           ("async_at_own_costs", max_staleness, asyn))
    }  # fmt: skip
    return {
        "steps_per_mode": steps,
        "async_max_staleness": max_staleness,
        "repeats": repeats,
        "ratios": [round(x, 3) for x in ratios],
        "ratio_async_over_sync": round(median(ratios), 3),
        "staleness_max_per_run": [r["async_partial"]["staleness_max"] for r in rounds],
        "ideal_ratio_from_sync_stages": round(ideal_ratio(sync), 3),
        "bound_ceiling_ratio": round(model["async_at_sync_costs"] / model["sync"], 3),
        "model_samples_per_s": {k: round(v, 3) for k, v in model.items()},
        **{f"{mode}/{k}": round(v, 4) for mode, r in mid.items() for k, v in r.items()},
        "targets": {"ratio": 3.0, "idle": 0.05},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--max-staleness", type=int, default=4, help="of the async mode (AReaL runs use 4-8)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of both modes; the ratio is their median")
    args = parser.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    print(json.dumps(asyncio.run(main(args.steps, args.max_staleness, args.repeats)), indent=2))
