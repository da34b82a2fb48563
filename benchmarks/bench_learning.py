"""How much a config's RL run gains in held-out success, over several seeds.

    python benchmarks/bench_learning.py [--config agentic_sokoban.yaml] [--seeds 3] [--out DIR] [key=value ...]

Each seed is one `agentrl train` of the config (sequentially: they share the machine) with its own RL seed and its
own draw of held-out levels (`validation.seed_start`), all from one warm start: `trainer.sft.cache` makes the first
run save it and the others reuse it. Prints JSON: per seed the held-out greedy success before RL and at every
validation, the sampled success (and tool calls per episode, for envs with tools) of the first and last training
batches, RL wall minutes (from the end of the warm start, the step-0 validation running beside the first steps,
to the end of the last validation) and the median RL step;
then the mean and standard deviation of the gain over seeds. key=value overrides apply to every seed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from agentrl.observe.metrics import read_jsonl

VAL_SEED_STRIDE = 100_000  # held-out level draws of different seeds do not overlap


def run_seed(config: str, seed: int, out: Path, overrides: list[str]) -> dict[str, Any]:
    run_dir = out / f"seed-{seed}"
    args = [sys.executable, "-m", "agentrl", "train", config, f"seed={seed}", f"logging.run_dir={run_dir}",
            f"validation.seed_start={1_000_000 + seed * VAL_SEED_STRIDE}", "trainer.sft.cache=true",
            "checkpoint.every_steps=0", "logging.tensorboard=false", *overrides]  # fmt: skip
    t0 = time.time()
    proc = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "COLUMNS": "160"})
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return summarize(run_dir, seed, time.time() - t0)


def summarize(run_dir: Path, seed: int, wall_s: float) -> dict[str, Any]:
    """One run's learning curve and costs, from its metrics.jsonl."""
    rows = list(read_jsonl(run_dir / "metrics.jsonl"))
    val = {r["step"]: r["val/success"] for r in rows if "val/success" in r}
    steps = [r for r in rows if "timing/step" in r]
    warm = next((r for r in rows if "sft/seconds" in r), {})
    if not steps:
        raise SystemExit(f"{run_dir}: no RL step in metrics.jsonl")
    rl_start = warm["time"] if warm else steps[0]["time"] - steps[0]["timing/step"]  # step 0 validates beside RL
    train_s = [r["timing/train"] for r in steps if "timing/train" in r]
    sampled = [r["episode/success"] for r in steps if "episode/success" in r]
    calls = [[v for key, v in r.items() if key.startswith("env/") and key.endswith("/tool_calls")] for r in steps]
    tools = [statistics.mean(c) for c in calls if c]  # per batch, over env tags that call tools
    k = max(1, min(5, len(sampled) // 4))  # a few batches at each end: one batch is noisy
    before, after = val.get(0), val[max(val)] if val else None
    return {
        "seed": seed,
        "val_success": val,
        "before": before,
        "after": after,
        "gain": None if before is None or after is None else after - before,
        "best": max(val.values()) if val else None,
        "sampled_success_first": statistics.mean(sampled[:k]) if sampled else None,
        "sampled_success_last": statistics.mean(sampled[-k:]) if sampled else None,
        "tool_calls_per_episode_first": statistics.mean(tools[:k]) if tools else None,
        "tool_calls_per_episode_last": statistics.mean(tools[-k:]) if tools else None,
        "warm_start_cached": bool(warm.get("sft/cached")),
        "warm_start_s": warm.get("sft/seconds"),
        "rl_wall_minutes": (max(r["time"] for r in rows) - rl_start) / 60,  # to the last validation's end
        "step_s_median": statistics.median(r["timing/step"] for r in steps),
        "trainer_s_median": statistics.median(train_s) if train_s else None,
        "run_wall_minutes": wall_s / 60,
    }


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def stats(key: str) -> dict[str, float | None]:
        xs = [r[key] for r in runs if r[key] is not None]
        return {
            "mean": statistics.mean(xs) if xs else None,
            "std": statistics.stdev(xs) if len(xs) > 1 else 0.0 if xs else None,
        }

    return {
        "gain": stats("gain"),
        "before": stats("before"),
        "after": stats("after"),
        "rl_wall_minutes": stats("rl_wall_minutes"),
        "step_s_median": statistics.median(r["step_s_median"] for r in runs if r["step_s_median"] is not None),
        "collapsed_seeds": [r["seed"] for r in runs if r["gain"] is not None and r["gain"] < 0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="agentic_sokoban.yaml")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--out", default="runs/bench_learning")
    ap.add_argument("overrides", nargs="*", help="dotted.key=value, applied to every seed")
    args = ap.parse_args()
    out = Path(args.out).absolute()
    load = os.getloadavg()
    runs = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        runs.append(run_seed(args.config, seed, out, args.overrides))
        print(json.dumps({"seed_done": runs[-1]}), file=sys.stderr, flush=True)
    report = {
        "bench": "learning",
        "config": args.config,
        "overrides": args.overrides,
        "seeds": args.seeds,
        "load_before": load,
        "load_after": os.getloadavg(),
        "runs": runs,
        **aggregate(runs),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
