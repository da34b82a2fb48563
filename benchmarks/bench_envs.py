"""Sokoban speed: env steps per second and reset (level generation) time for both presets, as JSON.

    python benchmarks/bench_envs.py [--levels 500] [--steps 20000]

`reset_ms_cold` generates a new level (reverse play + BFS check); `reset_ms_cached` resets to a level already
generated in this process (the training loop's common case: groups share task seeds). Step throughput is
measured with random-agent answers, including the answer parsing.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

import agentrl
from agentrl.envs.sokoban import generate_level

PRESETS = ("agentrl/SimpleSokoban-v0", "agentrl/LargerSokoban-v0")


def bench(env_id: str, levels: int, steps: int) -> dict:
    env = agentrl.make_env(env_id)
    generate_level.cache_clear()
    cold = []
    for seed in range(levels):
        t0 = time.perf_counter()
        env.reset(seed=seed)
        cold.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for seed in range(levels):
        env.reset(seed=seed)
    cached = (time.perf_counter() - t0) / levels
    rng = random.Random(0)
    answers = [env.random_action(rng) for _ in range(steps)]
    env.reset(seed=0)
    done, step_s = 0, 0.0
    for answer in answers:  # resets (cached levels) are timed above, not here
        t0 = time.perf_counter()
        *_, terminated, truncated, _ = env.step(answer)
        step_s += time.perf_counter() - t0
        done += 1
        if terminated or truncated:
            env.reset(seed=done % levels)
    expert_steps, t0 = 0, time.perf_counter()
    for seed in range(min(levels, 200)):
        env.reset(seed=seed)
        terminated = truncated = False
        while not (terminated or truncated):
            *_, terminated, truncated, _ = env.step(env.expert_action())
            expert_steps += 1
    expert_s = time.perf_counter() - t0
    cold_ms = sorted(1000 * c for c in cold)
    return {
        "steps_per_s": round(done / step_s),
        "expert_steps_per_s": round(expert_steps / expert_s),
        "reset_ms_cold_mean": round(statistics.mean(cold_ms), 3),
        "reset_ms_cold_p99": round(cold_ms[int(0.99 * (len(cold_ms) - 1))], 3),
        "reset_ms_cold_max": round(cold_ms[-1], 3),
        "reset_ms_cached": round(1000 * cached, 4),
        "levels": levels,
        "steps": done,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=int, default=500)
    parser.add_argument("--steps", type=int, default=20000)
    args = parser.parse_args()
    results = {env_id: bench(env_id, args.levels, args.steps) for env_id in PRESETS}
    print(json.dumps({"python": platform.python_version(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
