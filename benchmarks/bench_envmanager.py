"""Per-turn platform overhead of the env manager vs the env.step + engine time it wraps (JSON on stdout).

A scripted engine (replays the BFS expert's answer as tokens after a fixed `--engine-ms` delay, standing in for a
real generation) drives real SimpleSokoban envs through the real EpisodeRunner: token-exact history, chat-template
deltas, thread-pool env steps. Overhead per turn = wall per turn - time inside the engine call - env.step time,
measured with one episode at a time; a second run drives 256 episodes concurrently and reports turns/s.
Target: overhead <= 5%.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from agentrl.config.schema import EnvsConfig, ToolsConfig
from agentrl.envmanager.episode import EpisodeRunner
from agentrl.envs import make_env
from agentrl.models.tiny import resolve_model_path
from agentrl.types import EpisodeSpec, GenOutput


class ScriptedEngine:
    def __init__(self, tokenizer, delay_s: float):
        self.tok, self.delay_s, self.envs = tokenizer, delay_s, {}
        self.work_s = 0.0  # the script's own work (replaying the expert), not platform overhead
        self.call_s = 0.0  # wall time inside engine calls, incl. the simulated generation latency

    async def __call__(self, episode_id, ids, sampling, rid) -> GenOutput:
        t0 = time.perf_counter()
        env = self.envs.get(episode_id)
        if env is None:
            env = self.envs[episode_id] = make_env("agentrl/SimpleSokoban-v0")
            env.reset(seed=int(episode_id.split("/")[-2]))
        action = env.expert_action()
        env.step(action)
        out = [*self.tok(action, add_special_tokens=False)["input_ids"], self.tok.eos_token_id]
        self.work_s += time.perf_counter() - t0
        await asyncio.sleep(self.delay_s)
        self.call_s += time.perf_counter() - t0
        return GenOutput(out, [-0.1] * len(out), "stop", 0)


def _spec(seed: int) -> EpisodeSpec:
    return EpisodeSpec("agentrl/SimpleSokoban-v0", seed, "s", max_turns=15)


def _env_step_seconds(episodes: int) -> float:
    """Mean cost of env.step itself on the same expert trajectories."""
    total, turns = 0.0, 0
    for seed in range(episodes):
        env, replay = make_env("agentrl/SimpleSokoban-v0"), make_env("agentrl/SimpleSokoban-v0")
        env.reset(seed=seed)
        replay.reset(seed=seed)
        for _ in range(15):
            action = replay.expert_action()
            replay.step(action)
            t0 = time.perf_counter()
            _, _, term, trunc, _ = env.step(action)
            total += time.perf_counter() - t0
            turns += 1
            if term or trunc:
                break
    return total / turns


async def main(engine_ms: float, episodes: int, concurrent: int) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny"))
    engine = ScriptedEngine(tok, engine_ms / 1000)
    runner = EpisodeRunner(tok, engine, lambda i, k: make_env(i, **k), EnvsConfig(), ToolsConfig())
    await runner.run(_spec(10_000))  # warm-up
    t0, engine.work_s, engine.call_s = time.perf_counter(), 0.0, 0.0
    turns = 0
    for seed in range(episodes):
        turns += len((await runner.run(_spec(seed))).turns)
    wall_per_turn = (time.perf_counter() - t0 - engine.work_s) / turns
    engine_per_turn = (engine.call_s - engine.work_s) / turns
    env_step = _env_step_seconds(episodes)
    overhead = wall_per_turn - engine_per_turn - env_step
    t0 = time.perf_counter()
    results = await asyncio.gather(*(runner.run(_spec(20_000 + s)) for s in range(concurrent)))
    wall = time.perf_counter() - t0
    conc_turns = sum(len(r.turns) for r in results)
    return {
        "engine_ms_per_turn": round(engine_per_turn * 1000, 4),
        "env_step_ms": round(env_step * 1000, 4),
        "wall_ms_per_turn_sequential": round(wall_per_turn * 1000, 4),
        "platform_overhead_ms_per_turn": round(overhead * 1000, 4),
        "overhead_ratio": round(overhead / (engine_per_turn + env_step), 4),
        "target_overhead_ratio": 0.05,
        "concurrent_episodes": concurrent,
        "concurrent_turns_per_s": round(conc_turns / wall, 1),
        "concurrent_failures": sum(r.failed for r in results),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine-ms", type=float, default=20.0, help="scripted generation latency per turn")
    parser.add_argument("--episodes", type=int, default=40)
    parser.add_argument("--concurrent", type=int, default=256)
    a = parser.parse_args()
    print(json.dumps(asyncio.run(main(a.engine_ms, a.episodes, a.concurrent)), indent=2))
