"""The RL loop on one screen.

    warm start (SFT on expert demos)
    producer:  while admitted by the staleness bound: env managers roll out a group -> buffer
    trainer:   batch = buffer.get_batch(); train_step; export weights; engines.update_weights; log; save
    validation (at step 0 and when due) runs on the engines beside the next train step, which syncs its weights
    only after it

Every mode is this code with two parameters: async.max_staleness (0 = synchronous, 1 = one-step-off, k = fully
async) and async.partial_rollout (weight updates preempt in-flight generations, which resume on the new weights;
without it, updates wait for in-flight generations to finish). The policy version engines stamp on tokens is
the number of trained batches (the warm-start weights are version 0), the unit max_staleness counts in.

The loop drives the parts it is given (`agentrl.run.parts`: real actors, or a test's fakes) and nothing else.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from agentrl.config import Config
from agentrl.envmanager.manager import FirstOfKind, evaluate
from agentrl.observe.console import RunView
from agentrl.observe.metrics import MetricsSink
from agentrl.observe.step_metrics import batch_metrics
from agentrl.rollout.health import fleet_metrics
from agentrl.run.batch_files import batch_path, save_batch
from agentrl.run.buffer import Admission, RolloutStalled, SampleBuffer
from agentrl.run.episode_log import EpisodeLog, TokenTexts, advantages_by_episode, pick, sample_indices
from agentrl.run.parts import RunParts
from agentrl.run.signals import StopSignals
from agentrl.run.state import RunState, Snapshot, TaskSchedule, TrainedLog, load_run_state, save_run_state
from agentrl.run.validation import Validation
from agentrl.run.warm_start import warm_start
from agentrl.types import REPORTED_ADVANTAGES, EpisodeFailure, Group


class StepClock:
    """Where one step's wall time goes, as `timing/*` metrics."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.metrics: dict[str, float] = {}

    @contextmanager
    def timing(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.metrics[f"timing/{name}"] = time.perf_counter() - t0

    def wall(self) -> float:
        return time.perf_counter() - self.t0


class Pipeline:
    def __init__(self, cfg: Config, run_dir: Path, parts: RunParts, view: RunView | None = None) -> None:
        self.cfg, self.run_dir, self.parts = cfg, run_dir, parts
        self.trainer, self.weights, self.managers = parts.trainer, parts.weights, parts.managers
        train = cfg.envs.train
        self.group_sizes = {tag: spec.group_size for tag, spec in train.items()}
        self.buffer = SampleBuffer(
            batch_groups=sum(s.groups_per_batch for s in train.values()),
            batch_episodes=sum(s.groups_per_batch * s.group_size for s in train.values()),
            max_staleness=cfg.async_.max_staleness,
            drop_zero_variance=cfg.async_.drop_zero_variance_groups,
            stop_after_failed_groups=cfg.rollout.stop_after_failed_groups,
        )
        self.state = RunState(schedule=TaskSchedule.for_envs(train))
        self.trained_log = TrainedLog(run_dir / "trained_groups.jsonl")
        self.validation = Validation(cfg, lambda step: self.validate(step))
        self.signals = StopSignals()
        self.tasks: set[asyncio.Future] = set()
        self.log_failure = FirstOfKind("rollout")  # the env managers' logs stay in Ray's files; say it here
        self.fleet: dict[str, float] = {}  # the router's engine counts, logged with every step
        self._batch_wait: asyncio.Future | None = None
        self.view = view or RunView(cfg.trainer.total_steps, show=cfg.logging.console)  # also the console sink
        self.sink = MetricsSink(
            run_dir, self.view, cfg.logging.jsonl, cfg.logging.tensorboard, cfg.logging.trackers,
            cfg.logging.project, cfg.name, cfg.model_dump(mode="json", by_alias=True),
        )  # fmt: skip
        self.trainer_lock = asyncio.Lock()  # the loop's trainer calls vs. a weight sync for a restarted engine
        lg = cfg.logging
        self.episode_log = EpisodeLog(
            run_dir, lg.sample_every_steps, lg.sample_episodes, lg.episodes_max_mb,
            TokenTexts(cfg.model.tokenizer or parts.model_path), self.sink.log_episodes,
        )  # fmt: skip

    @property
    def stop_signal(self) -> int | None:
        return self.signals.received

    # ---- the loop --------------------------------------------------------------------------------------------
    async def run(self, resume_from: Path | None) -> dict[str, float]:
        self.signals.install(self._stop_waiting)
        await (self._resume(resume_from) if resume_from is not None else self._begin())
        self.validation.start(self.state.step)  # beside the next batch's rollout: the trainer waits for it anyway
        background = [self._background(self.produce()), self._background(self.watch_engines())]
        self.view.start_steps(self.state.step)
        try:
            while self.state.step < self.cfg.trainer.total_steps and self.stop_signal is None:
                metrics = await self.train_step()
                if metrics is not None:
                    self.sink.log(self.state.step, metrics)
        except RolloutStalled:
            self.validation.drop()
            await self.save()  # resumable: the stall came before the next batch was taken
            raise
        finally:
            for task in background:
                task.cancel()
        if self.stop_signal is not None:
            self.validation.drop()
        else:
            await self.validation.finish(self.state.step)
        await self.save()
        return {"first": self.state.first_val, "last": self.validation.last}

    async def _begin(self) -> None:
        self.trained_log.forget_after(0)  # a run killed before its first checkpoint starts again from scratch
        self.episode_log.forget_after(-1)
        sft = self.cfg.trainer.sft
        warm = sft.enabled and sft.steps > 0
        if warm:
            self.sink.log(0, await warm_start(self.cfg, self.parts, self.view, self.run_dir))
        await asyncio.to_thread(self.parts.loading.check)
        if warm:
            await self.weights.sync(0)

    async def _resume(self, checkpoint: Path) -> None:
        snapshot = await asyncio.to_thread(load_run_state, checkpoint, self.trainer, self.buffer)
        self.state = snapshot.state
        print(f"agentrl: {snapshot.describe()}", flush=True)
        self.trained_log.forget_after(self.state.step)
        self.episode_log.forget_after(self.state.step)
        await asyncio.to_thread(self.parts.loading.check)
        await self.weights.sync(self.state.step)  # a stop may have cut this step's validation short: run() reruns it

    async def train_step(self) -> dict[str, float] | None:
        """One RL step: a batch from the buffer, a trainer step, the new weights to the engines, then
        validation and a checkpoint when due. None when a stop signal came while waiting for the batch."""
        state, clock, stats_before = self.state, StepClock(), replace(self.buffer.stats)
        with clock.timing("rollout"):  # the trainer's wait for a batch
            groups = await self._next_batch()
        if groups is None:
            return None
        samples = [s for g in groups for s in g.samples]
        if self.cfg.logging.save_batches:
            await asyncio.to_thread(save_batch, batch_path(self.run_dir / "batches", state.step + 1), samples)
        metrics = batch_metrics(groups, samples, state.step)
        logged = self.episode_log.pick_batch(state.step + 1, groups)  # a few episodes to write, with advantages
        report = sample_indices([r for _, r in logged], samples)
        async with self.trainer_lock:
            with clock.timing("train"):
                metrics.update(await asyncio.to_thread(self.trainer.train_step, samples, report))
            state.step += 1
            state.trained += len(groups)
            self.trained_log.record(state.step, groups)
            metrics["train/version"] = float(self.trainer.version)
        reported = metrics.pop(REPORTED_ADVANTAGES, {})
        self.episode_log.write(state.step, "train", logged, advantages_by_episode(logged, samples, reported))
        with clock.timing("validation_wait"):  # the last step's validation, if it outlasted this step
            await self.validation.done()
        async with self.trainer_lock:
            with clock.timing("weight_sync"):
                sent = await self.weights.sync(state.step)
        if sent is not None:
            metrics["weight_sync/sent_mb"] = sent / 2**20
        await self.buffer.set_version(state.step)
        self.validation.start(state.step)
        if self.cfg.checkpoint.every_steps and state.step % self.cfg.checkpoint.every_steps == 0:
            await self.save()
        wall, tokens = clock.wall(), sum(s.num_model_tokens for s in samples)
        return {
            **metrics,
            **clock.metrics,
            **self.buffer.stats.metrics_since(stats_before, wall),
            **self.fleet,
            "timing/step": wall,
            "idle/trainer": clock.metrics["timing/rollout"] / wall,
            "throughput/tokens_per_s": tokens / wall,
            "throughput/samples_per_s": len(samples) / wall,
            "train/samples": float(len(samples)),
        }

    # ---- rollout side ----------------------------------------------------------------------------------------
    async def produce(self) -> None:
        """Start groups (ones to re-run first) for as long as the staleness bound admits them; never waits on the
        trainer directly."""
        while True:
            tag, seed = self.state.peek_task()
            admission = await self.buffer.admit(tag, seed, self.group_sizes[tag])
            self.state.take_task()  # no await since admit(): no snapshot can see the group twice or not at all
            manager = self.managers[admission.key % len(self.managers)]
            self.tasks.add(asyncio.ensure_future(self._run_group(manager, admission)))

    async def _run_group(self, manager: Any, admission: Admission) -> None:
        tag, seed = admission.tag, admission.seed
        try:
            result = await manager.run_group.remote(tag, seed)
        except Exception as err:  # a dead manager: every episode of the group failed; count them, keep going
            result = Group(tag=tag, seed=seed, failures=[EpisodeFailure(f"group {tag}/{seed}", str(err))])
            result.failures *= admission.episodes
        for failure in result.failures:
            self.log_failure(failure.episode, failure.error)
        await self.buffer.put(admission, result)
        self.tasks = {t for t in self.tasks if not t.done()}

    async def watch_engines(self, every_s: float = 2.0) -> None:
        """Print engine deaths and restarts as they happen; give an engine restarted between collective syncs
        the current weights at once (unless a step, whose own sync includes it, is under way); stop the run when
        no engine has been healthy for rollout.no_engine_timeout_s and none is being restarted (the trainer's
        wait for a batch raises RolloutStalled; a restart that never finishes times out in the router)."""
        timeout = self.cfg.rollout.no_engine_timeout_s
        while True:
            status = await self.parts.router.fleet_status.remote()
            for line in status["events"]:
                print(f"agentrl: {line}", file=sys.stderr, flush=True)
            self.fleet = fleet_metrics(status)
            if status["awaiting_weights"] and not self.trainer_lock.locked():
                async with self.trainer_lock:
                    await self.weights.sync(self.trainer.version)
                continue
            if status["no_live_s"] > timeout and not (status["restarting"] or status["awaiting_weights"]):
                await self.buffer.stall(
                    f"no healthy rollout engine for {status['no_live_s']:.0f} s (rollout.no_engine_timeout_s="
                    f"{timeout:g}); {status['deaths']} engine deaths, {status['restarts']} restarts"
                )
                return
            await asyncio.sleep(every_s)

    async def validate(self, step: int) -> dict[str, float]:
        """Held-out episodes on the engines' current weights (those of `step`), logged at that step."""
        episodes = len(self.cfg.envs.val or self.cfg.envs.train) * self.cfg.validation.episodes_per_tag
        with self.view.phase(f"validation at step {step}", episodes, "episodes") as tick:
            result, records = await evaluate(self.cfg, self.managers, tick)
        self.sink.log(step, result)
        if self.episode_log.every_steps:
            self.episode_log.write(step, "validation", pick(records, self.episode_log.per_tag, seed=step))
        if step == 0:
            self.state.first_val = result  # before RL
        return result

    # ---- plumbing --------------------------------------------------------------------------------------------
    def _background(self, work: Any) -> asyncio.Task:
        """A task beside the training loop; if it fails, the loop's wait for a batch raises instead of hanging."""
        task = asyncio.ensure_future(work)

        def check(done: asyncio.Task) -> None:
            if not done.cancelled() and done.exception() is not None:
                err = done.exception()
                self.tasks.add(asyncio.ensure_future(self.buffer.stall(f"{work.__name__} failed: {err!r}")))

        task.add_done_callback(check)
        return task

    async def _next_batch(self) -> list[Group] | None:
        """The buffer's next batch, or None if a stop signal interrupts the wait (no group is taken then)."""
        self._batch_wait = asyncio.ensure_future(self.buffer.get_batch())
        try:
            return await self._batch_wait
        except asyncio.CancelledError:
            if self.stop_signal is None:
                raise
            return None

    def _stop_waiting(self) -> None:
        if self._batch_wait is not None:
            self._batch_wait.cancel()

    async def save(self) -> Path:
        snapshot = Snapshot.take(self.state, self.buffer)  # one instant: taken before anything is awaited
        async with self.trainer_lock:
            return await asyncio.to_thread(
                save_run_state, self.run_dir, snapshot, self.trainer, self.cfg.checkpoint.keep_last
            )

    def close(self) -> None:
        """The loop's own files; whoever built the parts closes them."""
        self.episode_log.close()  # its last files go to the trackers too
        self.sink.close()
