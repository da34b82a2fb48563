"""Fully async + partial rollout vs synchronous RL on a long-tail workload, same model and cores, in one run.

The workload (agentrl/LongTail-v0) has very uneven episode lengths and heavy-tailed step latency, so a
synchronous batch waits for its slowest episode. Prints JSON: trained samples/s of each mode (steps after the
first) over `--repeats` interleaved rounds, the median of the per-round ratios (target >= 3), the async runs'
staleness maxima, and, for the median round, trainer/rollout idle fractions (target <= 5%), stage times and the
ideal ratio from the sync run's stage times ((rollout + train + sync) / (train + sync): rollout fully hidden).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from statistics import mean, median, median_low

import ray

from agentrl.config import load_config
from agentrl.metrics import read_jsonl
from agentrl.pipeline import Pipeline

WORKLOAD = [
    "envs.train={lt: {env_id: agentrl/LongTail-v0, max_turns: 12, group_size: 4, groups_per_batch: 4,"
    " kwargs: {latency_s: 0.05, latency_tail: 1.2, median_turns: 2, max_steps: 12}}}",
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
    pipeline = Pipeline(cfg, root / mode)
    try:
        await pipeline.run(resume_from=None)
    finally:
        pipeline.close()
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
    }


def ideal_ratio(sync: dict[str, float]) -> float:
    """The speed-up if rollout were fully hidden behind training: (rollout + train + sync) / (train + sync)."""
    return (sync["rollout_s"] + sync["train_s"] + sync["weight_sync_s"]) / (sync["train_s"] + sync["weight_sync_s"])


async def main(steps: int, max_staleness: int, repeats: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix="agentrl-bench-"))
    rounds = []
    for i in range(repeats):  # interleaved: a load change on the machine hits both modes alike
        rounds.append({mode: await run_mode(mode, steps, root / f"round{i}", max_staleness) for mode in MODES})
    ratios = [r["async_partial"]["samples_per_s"] / r["sync"]["samples_per_s"] for r in rounds]
    mid = rounds[ratios.index(median_low(ratios))]  # the round whose ratio is the median: its stage times
    return {
        "steps_per_mode": steps,
        "async_max_staleness": max_staleness,
        "repeats": repeats,
        "ratios": [round(x, 3) for x in ratios],
        "ratio_async_over_sync": round(median(ratios), 3),
        "staleness_max_per_run": [r["async_partial"]["staleness_max"] for r in rounds],
        "ideal_ratio_from_sync_stages": round(ideal_ratio(mid["sync"]), 3),
        **{f"{mode}/{k}": round(v, 4) for mode, r in mid.items() for k, v in r.items()},
        "targets": {"ratio": 3.0, "idle": 0.05},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--max-staleness", type=int, default=4, help="of the async mode (AReaL runs use 4-8)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of both modes; the ratio is their median")
    args = parser.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    print(json.dumps(asyncio.run(main(args.steps, args.max_staleness, args.repeats)), indent=2))
