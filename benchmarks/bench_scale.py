"""Scaling of the platform itself: env managers, router and buffer under 256 .. 16k concurrent episodes (JSON out).

Usage: python benchmarks/bench_scale.py [--episodes 256 1024 4096 16384] [--managers 1 2 4] [--latency-ms 20]
       [--turns 8] [--seconds 6] [--max-per-manager 4096] [--profile]

No model: a scripted engine actor (a `GatedEngine` whose "generation" is an asyncio sleep of `--latency-ms`, then a
fixed answer) is placed by the real router actor (each episode on its own, those starting together in one lease
call; the turns go from the env manager to the engine directly, as in a run), and a trivial registered text env ends
after `--turns` turns. The env managers are real Ray actors started as `start_managers` starts them, and groups are
admitted, put and taken through the real `SampleBuffer` on this driver's loop, as `Pipeline.produce` does. The
buffer's staleness bound keeps exactly `--episodes` episodes in flight.

Per cell, after a warm-up (every episode has had a turn), over a `--seconds` window:
- turns_per_s: engine requests served per second (one per model turn).
- manager_cpu_ms_per_turn: CPU time of the env-manager processes per turn (from /proc), the platform's per-turn
  overhead; overhead_ratio is it over the engine latency (target <= 0.05 at 256 episodes per manager).
  manager_idle_cpu_ms_per_s: what one manager process burns with no episodes (a share of every turn's CPU when
  turns per manager are few).
  router/engine/driver CPU per turn are reported beside it (the engine's is Ray's receive path plus the fake).
- wall_ms_per_turn: episodes / turns_per_s (Little's law): what one episode waits per turn, latency included.
- manager_rss_kb_per_episode: manager RSS with the episodes in flight minus after a warm-up group, per episode.
- loop_lag_p99_ms: how late a 10 ms timer on each manager's event loop fires (p99; max over managers).
On a machine with few cores the cells are CPU-bound (turns_per_s is then CPU / CPU per turn); the CPU per turn is
the number that says whether a cost grows with the number of concurrent episodes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import ray

from agentrl.config.schema import Config, SamplingConfig
from agentrl.envmanager.manager import EnvManager
from agentrl.envs.base import TextEnv
from agentrl.models.tiny import resolve_model_path
from agentrl.platform import worker_env
from agentrl.rollout.base import Completion, GatedEngine, WeightSource
from agentrl.rollout.router import Router
from agentrl.rollout.turn_mailbox import TurnMailbox
from agentrl.run.buffer import Admission, SampleBuffer
from agentrl.types import Group

ENV_ID = "bench/CountTurns-v0"
GROUP_SIZE = 8
_TICK = os.sysconf("SC_CLK_TCK")


class CountTurnsEnv(TextEnv):
    """A text env that ends after `turns` turns whatever the model says: all cost left is the platform's."""

    def __init__(self, turns: int = 8, **kwargs: Any):
        super().__init__(max_steps=turns, **kwargs)

    def system_prompt(self) -> str:
        return "You are a benchmark. Answer anything."

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        self.turns = 0
        return f"Task {seed}: turn 0 of {self.max_steps}.", {"metrics": {}}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self.turns += 1
        done = self.turns >= self.max_steps
        metrics = {"success": float(done), "action_is_valid": 1.0, "action_is_effective": 1.0}
        return f"Turn {self.turns} of {self.max_steps}: ok.", 0.0, done, False, {"metrics": metrics}


def _register() -> None:
    from agentrl.envs import register_env

    register_env(ENV_ID, CountTurnsEnv)


class ScriptedEngine(TurnMailbox, GatedEngine):
    """The rollout-engine contract with no model: every request sleeps `latency_s`, then returns `answer`."""

    def __init__(self, answer: list[int], latency_s: float):
        super().__init__()
        self.answer, self.latency_s = answer, latency_s

    async def start(self) -> dict[str, Any]:
        return {}

    async def _complete(self, token_ids: list[int], sampling: SamplingConfig, request_id: str) -> Completion:
        await asyncio.sleep(self.latency_s)
        return list(self.answer), [-0.5] * len(self.answer), "stop"

    async def _abort_ids(self, request_ids: list[str]) -> None:
        return None

    async def _load_weights(self, source: WeightSource, version: int) -> None:
        return None

    async def health(self) -> dict[str, Any]:
        return {"ok": True}

    async def pid(self) -> int:
        return os.getpid()


class BenchManager(EnvManager):
    """The real EnvManager plus what the benchmark reads: its pid, an event-loop lag probe and cProfile."""

    def __init__(self, *args: Any, **kwargs: Any):
        _register()  # the env class travels with this (pickled-by-value) module
        super().__init__(*args, **kwargs)
        self._lags: list[float] = []
        self._probe: asyncio.Task | None = None
        self._profiler: Any = None

    async def pid(self) -> int:
        return os.getpid()

    async def start_lag_probe(self, every_s: float = 0.01) -> None:
        async def probe() -> None:
            while True:
                t0 = time.perf_counter()
                await asyncio.sleep(every_s)
                self._lags.append(time.perf_counter() - t0 - every_s)

        if self._probe is None:
            self._probe = asyncio.ensure_future(probe())
        self._lags = []

    async def lag_p99_ms(self) -> float:
        lags = sorted(self._lags)
        return 1000 * lags[min(len(lags) - 1, int(0.99 * len(lags)))] if lags else float("nan")

    async def profile(self, on: bool, top: int = 25) -> str:
        import cProfile
        import io
        import pstats

        if on:
            self._profiler = cProfile.Profile()
            self._profiler.enable()
            return ""
        self._profiler.disable()
        out = io.StringIO()
        pstats.Stats(self._profiler, stream=out).sort_stats("tottime").print_stats(top)
        return out.getvalue()


class PidRouter(Router):
    """The real Router plus its pid (for /proc CPU readings); started with `start_router`'s options."""

    async def pid(self) -> int:
        return os.getpid()


def _say(*parts: Any) -> None:
    """Progress on stderr (stdout is JSON)."""
    print(time.strftime("%H:%M:%S"), *parts, file=sys.stderr, flush=True)


def _proc(pid: int) -> tuple[float, int]:
    """(CPU seconds, RSS bytes) of a process on this node, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime
    with open(f"/proc/{pid}/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return cpu, rss


def _config(managers: int, turns: int) -> Config:
    return Config.model_validate({
        "envs": {
            "train": {"count": {"env_id": ENV_ID, "group_size": GROUP_SIZE, "kwargs": {"turns": turns}}},
            "num_managers": managers,
        },
        "rollout": {"sampling": {"max_tokens": 16}},
    })  # fmt: skip


async def run_cell(episodes: int, managers: int, latency_ms: float, turns: int, seconds: float, profile: bool) -> dict:
    """One grid cell: fresh engine, router and managers; `episodes` in flight; measured over `seconds`."""
    from transformers import AutoTokenizer

    cfg = _config(managers, turns)
    model = resolve_model_path(cfg.model.path)
    tok = AutoTokenizer.from_pretrained(model)
    answer = [*tok("<answer>ok</answer>", add_special_tokens=False)["input_ids"], tok.eos_token_id]
    engine = ray.remote(ScriptedEngine).options(max_concurrency=100_000, num_cpus=0).remote(answer, latency_ms / 1000)
    router = ray.remote(PidRouter).options(max_concurrency=100_000, num_cpus=0).remote([engine], cfg.rollout)
    cls = ray.remote(BenchManager).options(max_concurrency=100_000, num_cpus=0, runtime_env={"env_vars": worker_env()})
    mgrs = [cls.remote(cfg, model, router, None, i) for i in range(managers)]
    pids = {
        "manager": await asyncio.gather(*(m.pid.remote() for m in mgrs)),
        "router": [await router.pid.remote()],
        "engine": [await engine.pid.remote()],
    }
    _say(f"cell {episodes} episodes / {managers} managers: actors up {pids}")
    warm = await asyncio.gather(*(m.run_group.remote("count", 10**9 + i) for i, m in enumerate(mgrs)))
    if any(g.failures for g in warm):
        raise RuntimeError(f"warm-up group failed: {warm[0].failures[:1]}")
    rss_idle = sum(_proc(p)[1] for p in pids["manager"])
    idle0, t_idle = sum(_proc(p)[0] for p in pids["manager"]), time.perf_counter()
    await asyncio.sleep(2.0)  # what the manager processes burn with no episode (Ray's own threads), per manager
    idle_ms_per_s = 1000 * (sum(_proc(p)[0] for p in pids["manager"]) - idle0) / (time.perf_counter() - t_idle)

    buffer = SampleBuffer(
        batch_groups=1, batch_episodes=GROUP_SIZE, max_staleness=episodes // GROUP_SIZE - 1, drop_zero_variance=False
    )
    tasks: set[asyncio.Future] = set()
    failures = [0]

    async def run_group(manager: Any, admission: Admission) -> None:
        try:
            group = await manager.run_group.remote(admission.tag, admission.seed)
        except Exception as err:
            group = Group(tag=admission.tag, seed=admission.seed, failures=[repr(err)] * admission.episodes)
        failures[0] += len(group.failures)
        await buffer.put(admission, group)

    async def produce() -> None:
        seed = 0
        while True:
            admission = await buffer.admit("count", seed, GROUP_SIZE)
            seed += 1
            task = asyncio.ensure_future(run_group(mgrs[admission.key % managers], admission))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def consume() -> None:
        taken = 0
        while True:
            taken += len(await buffer.get_batch())
            await buffer.set_version(taken)

    async def served() -> int:
        return (await engine.stats.remote())["requests_done"]

    def snapshot() -> dict[str, float]:
        snap = {"t": time.perf_counter(), "driver": time.process_time()}
        for role, ps in pids.items():
            snap[role] = sum(_proc(p)[0] for p in ps)
        snap["rss"] = sum(_proc(p)[1] for p in pids["manager"])
        return snap

    background = [asyncio.ensure_future(produce()), asyncio.ensure_future(consume())]
    t_start = time.perf_counter()
    base = await served()
    while await served() - base < episodes:  # warm-up: every episode started and had (about) a turn
        await asyncio.sleep(0.5)
        _say(f"warm-up: {await served() - base} turns, {failures[0]} failed episodes")
    warmup_s = time.perf_counter() - t_start
    await asyncio.gather(*(m.start_lag_probe.remote() for m in mgrs))
    if profile:
        await mgrs[0].profile.remote(True)
    n0, s0 = await served(), snapshot()
    rss_samples = []
    while time.perf_counter() - s0["t"] < seconds:
        await asyncio.sleep(min(1.0, seconds / 4))
        rss_samples.append(sum(_proc(p)[1] for p in pids["manager"]))
    n1, s1 = await served(), snapshot()
    report = await mgrs[0].profile.remote(False) if profile else None
    lag = max(await asyncio.gather(*(m.lag_p99_ms.remote() for m in mgrs)))
    for task in background:
        task.cancel()
    for task in list(tasks):
        task.cancel()
    for handle in [*mgrs, router, engine]:
        ray.kill(handle)
    await asyncio.sleep(0.5)

    turns_done, wall = n1 - n0, s1["t"] - s0["t"]
    per_turn = {role: 1000 * (s1[role] - s0[role]) / max(1, turns_done) for role in ("manager", "router", "engine")}
    per_turn["driver"] = 1000 * (s1["driver"] - s0["driver"]) / max(1, turns_done)
    rate = turns_done / wall
    result = {
        "episodes": episodes,
        "managers": managers,
        "episodes_per_manager": episodes // managers,
        "latency_ms": latency_ms,
        "turns_per_episode": turns,
        "warmup_s": round(warmup_s, 1),
        "window_s": round(wall, 1),
        "turns": turns_done,
        "turns_per_s": round(rate, 1),
        "wall_ms_per_turn": round(1000 * episodes / rate, 2) if rate else None,
        "manager_cpu_ms_per_turn": round(per_turn["manager"], 4),
        "overhead_ratio": round(per_turn["manager"] / latency_ms, 4),
        "manager_idle_cpu_ms_per_s": round(idle_ms_per_s / managers, 2),
        "router_cpu_ms_per_turn": round(per_turn["router"], 4),
        "engine_cpu_ms_per_turn": round(per_turn["engine"], 4),
        "driver_cpu_ms_per_turn": round(per_turn["driver"], 4),
        "manager_rss_kb_per_episode": round((statistics.median(rss_samples) - rss_idle) / 1024 / episodes, 1),
        "loop_lag_p99_ms": round(lag, 2),
        "failed_episodes": failures[0],
        "loadavg_1m": float(Path("/proc/loadavg").read_text().split()[0]),
    }
    if report:
        result["profile"] = report
    return result


async def main(args: argparse.Namespace) -> list[dict]:
    from agentrl.run.startup import init_ray

    init_ray(None)
    _register()
    results = []
    for managers in args.managers:
        for episodes in args.episodes:
            if episodes > managers * args.max_per_manager:
                continue
            cell = await run_cell(episodes, managers, args.latency_ms, args.turns, args.seconds, args.profile)
            profile = cell.pop("profile", None)
            print(json.dumps(cell), flush=True)
            if profile:
                print(profile, flush=True)
            results.append(cell)
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, nargs="+", default=[256, 1024, 4096, 16384], help="in flight")
    parser.add_argument("--managers", type=int, nargs="+", default=[1, 2, 4], help="env-manager actors")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="scripted engine latency per turn")
    parser.add_argument("--turns", type=int, default=8, help="turns per episode (the env ends after them)")
    parser.add_argument("--seconds", type=float, default=6.0, help="measurement window per cell, after warm-up")
    parser.add_argument(
        "--max-per-manager", type=int, default=4096, help="skip cells with more episodes per manager than this"
    )
    parser.add_argument("--profile", action="store_true", help="cProfile manager 0 over the window (top 25)")
    cells = asyncio.run(main(parser.parse_args()))
    with contextlib.suppress(Exception):
        ray.shutdown()
    print(json.dumps({"cells": cells, "loadavg": Path("/proc/loadavg").read_text().split()[:3]}, indent=1))
