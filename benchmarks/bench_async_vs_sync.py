"""Fully async + partial rollout vs synchronous RL on a long-tail workload, same model and cores, in one run.

The workload (agentrl/LongTail-v0) has very uneven episode lengths and heavy-tailed step latency, so a
synchronous batch waits for its slowest episode. Prints JSON: trained samples/s of each mode (steps after the
first), their ratio (target >= 2.5), trainer/rollout idle fractions (target <= 5%), and the ideal ratio from the
sync run's measured stage times ((rollout + train + sync) / (train + sync): rollout fully hidden).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from statistics import mean

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


async def main(steps: int, max_staleness: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix="agentrl-bench-"))
    results = {mode: await run_mode(mode, steps, root, max_staleness) for mode in MODES}
    sync = results["sync"]
    return {
        "steps_per_mode": steps,
        "async_max_staleness": max_staleness,
        **{f"{mode}/{k}": round(v, 4) for mode, r in results.items() for k, v in r.items()},
        "ratio_async_over_sync": round(results["async_partial"]["samples_per_s"] / sync["samples_per_s"], 3),
        "ideal_ratio_from_sync_stages": round(
            (sync["rollout_s"] + sync["train_s"] + sync["weight_sync_s"]) / (sync["train_s"] + sync["weight_sync_s"]), 3
        ),
        "targets": {"ratio": 2.5, "idle": 0.05},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--max-staleness", type=int, default=4, help="of the async mode (AReaL runs use 4-8)")
    args = parser.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    print(json.dumps(asyncio.run(main(args.steps, args.max_staleness)), indent=2))
