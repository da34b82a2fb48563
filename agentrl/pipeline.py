"""`agentrl train`: the whole RL loop on one screen.

    warm start (SFT on expert demos) -> validate
    producer:  while admitted by the staleness bound: env managers roll out a group -> buffer
    trainer:   batch = buffer.get_batch(); train_step; export weights; engines.update_weights; log; validate; save

Every mode is this code with two parameters: async.max_staleness (0 = synchronous, 1 = one-step-off, k = fully
async) and async.partial_rollout (weight updates preempt in-flight generations, which resume on the new weights;
without it, updates wait for in-flight generations to finish). The policy version engines stamp on tokens is
the number of trained batches (the warm-start weights are version 0), the unit max_staleness counts in.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray

from agentrl.buffer import SampleBuffer
from agentrl.config import Config, dump_yaml
from agentrl.envmanager.manager import check_turn_limits, evaluate, start_managers
from agentrl.metrics import MetricsSink
from agentrl.models.tiny import resolve_model_path
from agentrl.platform import configure_cpu_threads
from agentrl.rollout.fleet import start_engines, start_router
from agentrl.run_state import RunState, TaskSchedule, latest_checkpoint, load_run_state, save_run_state
from agentrl.step_metrics import batch_metrics
from agentrl.trainer import TrainerGroup
from agentrl.types import Group


@contextmanager
def timed(metrics: dict[str, float], key: str) -> Iterator[None]:
    """Seconds spent in the block, into metrics[key]."""
    t0 = time.perf_counter()
    yield
    metrics[key] = time.perf_counter() - t0


class Pipeline:
    def __init__(self, cfg: Config, run_dir: Path):
        check_turn_limits(cfg)  # before anything slow starts
        self.cfg = cfg
        self.run_dir = run_dir
        self.model_path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
        self.trainer = TrainerGroup(cfg, self.model_path)
        self.engines = start_engines(cfg.rollout, self.model_path, seed=cfg.seed)
        self.router = start_router(self.engines, cfg.rollout)
        self.reward_pool = self._reward_pool()
        self.managers = start_managers(cfg, self.model_path, self.router, self.reward_pool)
        train = cfg.envs.train
        self.group_sizes = {tag: spec.group_size for tag, spec in train.items()}
        self.buffer = SampleBuffer(
            batch_groups=sum(s.groups_per_batch for s in train.values()),
            batch_episodes=sum(s.groups_per_batch * s.group_size for s in train.values()),
            max_staleness=cfg.async_.max_staleness,
            drop_zero_variance=cfg.async_.drop_zero_variance_groups,
        )
        self.state = RunState(schedule=TaskSchedule.for_envs(train))
        self.in_flight: dict[int, tuple[str, int]] = {}
        self.last_val: dict[str, float] = {}
        self.tasks: set[asyncio.Future] = set()
        self.sink = MetricsSink(
            run_dir,
            cfg.logging.console,
            cfg.logging.jsonl,
            cfg.logging.tensorboard,
            cfg.logging.trackers,
            cfg.logging.project,
            cfg.name,
            cfg.model_dump(mode="json", by_alias=True),
        )
        self.weights_root = Path("/dev/shm" if Path("/dev/shm").is_dir() else run_dir) / f"agentrl-{cfg.name}-weights"

    def _reward_pool(self) -> Any:
        if not self.cfg.reward.functions:
            return None
        from agentrl.reward import RewardPool

        return RewardPool(self.cfg.reward, judge_router=self.router)

    # ---- rollout side ----------------------------------------------------------------------------------------
    async def produce(self) -> None:
        """Start groups for as long as the staleness bound admits them; never waits on the trainer directly."""
        for tag, seed in self.state.take_resumed():
            await self._start_group(tag, seed)
        while True:
            tag, seed = self.state.schedule.next()
            await self._start_group(tag, seed)

    async def _start_group(self, tag: str, seed: int) -> None:
        size = self.group_sizes[tag]
        version = await self.buffer.admit(size)
        key = self.state.next_group_key()
        self.in_flight[key] = (tag, seed)
        manager = self.managers[key % len(self.managers)]
        self.tasks.add(asyncio.ensure_future(self._run_group(manager, key, tag, seed, size, version)))

    async def _run_group(self, manager: Any, key: int, tag: str, seed: int, size: int, version: int) -> None:
        try:
            result = await manager.run_group.remote(tag, seed)
        except Exception as err:  # a dead manager or engine fleet: count it, keep going
            result = Group(tag=tag, seed=seed, failures=[f"group {tag}/{seed}: {err}"])
        self.in_flight.pop(key, None)
        result.admitted_version = version
        await self.buffer.put(result, size)
        self.tasks = {t for t in self.tasks if not t.done()}

    # ---- weights ---------------------------------------------------------------------------------------------
    async def sync_weights(self, version: int) -> None:
        path = str(self.weights_root / f"v{version}")
        await asyncio.to_thread(self.trainer.export_weights, path)
        drain = "abort" if self.cfg.async_.partial_rollout else "wait"
        await self.router.update_weights.remote(path, version, drain)
        for old in self.weights_root.glob("v*"):
            if old.name != f"v{version}":
                shutil.rmtree(old, ignore_errors=True)

    # ---- validation / warm start -----------------------------------------------------------------------------
    async def validate(self) -> dict[str, float]:
        return await evaluate(self.cfg, self.managers)

    async def warm_start(self) -> dict[str, float]:
        from transformers import AutoTokenizer

        from agentrl.warmstart import expert_samples

        sft = self.cfg.trainer.sft
        tokenizer = AutoTokenizer.from_pretrained(self.cfg.model.tokenizer or self.model_path)
        demos = await asyncio.to_thread(expert_samples, self.cfg, tokenizer, sft.episodes)
        t0, metrics = time.perf_counter(), {}
        for step in range(sft.steps):
            start = (step * sft.batch_size) % max(1, len(demos) - sft.batch_size)
            metrics = await asyncio.to_thread(self.trainer.sft_step, demos[start : start + sft.batch_size])
        return {**metrics, "sft/seconds": time.perf_counter() - t0, "sft/samples": len(demos)}

    # ---- the loop --------------------------------------------------------------------------------------------
    async def run(self, resume_from: Path | None) -> dict[str, float]:
        cfg, state = self.cfg, self.state
        if resume_from is not None:
            state = self.state = await asyncio.to_thread(load_run_state, resume_from, self.trainer, self.buffer)
            await self.sync_weights(state.step)
        else:
            if cfg.trainer.sft.enabled and cfg.trainer.sft.steps > 0:
                self.sink.log(0, await self.warm_start())
                await self.sync_weights(0)
            if self._validates():
                state.first_val = await self.validate()
                self.sink.log(state.step, state.first_val)
        producer = asyncio.ensure_future(self.produce())
        try:
            while state.step < cfg.trainer.total_steps:
                metrics = await self.train_step()
                self.sink.log(state.step, metrics)
        finally:
            producer.cancel()
        if self._validates() and not self._validates(state.step):
            self.last_val = await self.validate()
            self.sink.log(state.step, self.last_val)
        await self.save()
        return {"first": state.first_val, "last": self.last_val}

    async def train_step(self) -> dict[str, float]:
        """One RL step: a batch from the buffer, a trainer step, the new weights to the engines, then
        validation and a checkpoint when due."""
        state, metrics = self.state, {}
        t_step, stats_before = time.perf_counter(), replace(self.buffer.stats)
        with timed(metrics, "timing/rollout"):  # the trainer's wait for a batch
            groups = await self.buffer.get_batch()
        samples = [s for g in groups for s in g.samples]
        self._record_trained(state.step + 1, groups)
        metrics.update(batch_metrics(groups, samples, state.step))
        with timed(metrics, "timing/train"):
            metrics.update(await asyncio.to_thread(self.trainer.train_step, samples))
        state.step += 1
        metrics["train/version"] = float(self.trainer.version)
        with timed(metrics, "timing/weight_sync"):
            await self.sync_weights(state.step)
        await self.buffer.set_version(state.step)
        if self._validates(state.step):
            self.last_val = await self.validate()
            metrics.update(self.last_val)
        if self.cfg.checkpoint.every_steps and state.step % self.cfg.checkpoint.every_steps == 0:
            await self.save()
        wall = time.perf_counter() - t_step
        tokens = sum(s.num_model_tokens for s in samples)
        metrics.update(self.buffer.stats.metrics_since(stats_before, wall))
        metrics.update({
            "timing/step": wall,
            "idle/trainer": metrics["timing/rollout"] / wall,
            "throughput/tokens_per_s": tokens / wall,
            "throughput/samples_per_s": len(samples) / wall,
            "train/samples": float(len(samples)),
        })  # fmt: skip
        return metrics

    def _validates(self, step: int | None = None) -> bool:
        """Whether validation runs at all (step None), or after `step`."""
        every = self.cfg.validation.every_steps
        return bool(every and self.cfg.envs.val) and (step is None or step % every == 0)

    def _record_trained(self, step: int, groups: list[Group]) -> None:
        """Which task groups each step trained on (resume tests read it; handy to audit a run)."""
        with (self.run_dir / "trained_groups.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, "groups": [f"{g.tag}/{g.seed}" for g in groups]}) + "\n")

    async def save(self) -> Path:
        pending = list(self.in_flight.values())
        return await asyncio.to_thread(
            save_run_state, self.run_dir, self.state, self.trainer, self.buffer, pending, self.cfg.checkpoint.keep_last
        )

    def close(self) -> None:
        self.sink.close()
        self.trainer.shutdown()
        for handle in [*self.managers, self.router, *self.engines]:
            ray.kill(handle)
        shutil.rmtree(self.weights_root, ignore_errors=True)


def train(cfg: Config, resume: str | None = None) -> int:
    """Run (or resume) a training run; prints held-out success before and after RL."""
    configure_cpu_threads(1)
    run_dir = Path(resume or cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    resume_from = latest_checkpoint(run_dir) if (resume or cfg.checkpoint.resume == "auto") else None
    if not ray.is_initialized():
        ray.init(address=cfg.ray_address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    pipeline = Pipeline(cfg, run_dir)
    try:
        result = asyncio.run(pipeline.run(resume_from))
    finally:
        pipeline.close()
    first, last = result["first"], result["last"]
    if "val/success" in last:
        before = f"{first['val/success']:.3f}" if "val/success" in first else "n/a"
        print(f"held-out success: before RL {before}, after RL {last['val/success']:.3f}")
    from agentrl.plotting import plot_run

    print(f"run dir: {run_dir}  plot: {plot_run(run_dir)}")
    return 0
