"""`agentrl train`: the whole RL loop on one screen.

    warm start (SFT on expert demos)
    producer:  while admitted by the staleness bound: env managers roll out a group -> buffer
    trainer:   batch = buffer.get_batch(); train_step; export weights; engines.update_weights; log; save
    validation (at step 0 and when due) runs on the engines beside the next train step, which syncs its weights
    only after it

Every mode is this code with two parameters: async.max_staleness (0 = synchronous, 1 = one-step-off, k = fully
async) and async.partial_rollout (weight updates preempt in-flight generations, which resume on the new weights;
without it, updates wait for in-flight generations to finish). The policy version engines stamp on tokens is
the number of trained batches (the warm-start weights are version 0), the unit max_staleness counts in.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray

from agentrl.batch_files import batch_path, save_batch
from agentrl.buffer import Admission, RolloutStalled, SampleBuffer
from agentrl.config import Config, ConfigError, dump_yaml
from agentrl.console import RunView, print_summary, run_summary
from agentrl.envmanager.manager import FirstOfKind, evaluate, start_managers
from agentrl.metrics import MetricsSink
from agentrl.models.hub import model_ref
from agentrl.models.tiny import resolve_model_path
from agentrl.platform import cluster_platform, configure_cpu_threads
from agentrl.rollout.fleet import create_engines, start_router
from agentrl.rollout.router import fleet_metrics
from agentrl.run_state import (
    RunState,
    Snapshot,
    TaskSchedule,
    TrainedLog,
    latest_checkpoint,
    load_run_state,
    save_run_state,
)
from agentrl.startup import check_before_start, init_ray
from agentrl.step_metrics import batch_metrics
from agentrl.trainer import TrainerGroup
from agentrl.types import Group
from agentrl.warmstart import is_cached, warm_start_cache
from agentrl.weights import WeightSync


@contextmanager
def timed(metrics: dict[str, float], key: str) -> Iterator[None]:
    """Seconds spent in the block, into metrics[key]."""
    t0 = time.perf_counter()
    yield
    metrics[key] = time.perf_counter() - t0


class Pipeline:
    def __init__(self, cfg: Config, run_dir: Path, view: RunView | None = None):
        self.cfg = cfg
        self.run_dir = run_dir
        self.model_path = resolve_model_path(cfg.model.path, cfg.model.cache_dir, cfg.model.revision)
        # What actors get: a hub id stays one, resolved by each actor on its own node (a snapshot path is this one's)
        ref = model_ref(cfg.model.path, cfg.model.revision, self.model_path)
        self.warm_cache = warm_start_cache(cfg, self.model_path)  # trainer.sft.cache: where the warm start is kept
        if is_cached(self.warm_cache):  # an earlier run's warm start replaces the base weights and the SFT
            ref = self.model_path = str(self.warm_cache)
        platform = cluster_platform(cfg.platform)  # from the cluster's resources, not this (head) node's devices
        check_before_start(cfg, self.model_path, platform)
        self.engines = create_engines(cfg.rollout, ref, seed=cfg.seed, platform=platform)
        self.router = start_router(self.engines, cfg.rollout, model_path=ref, seed=cfg.seed)
        # Engines load their weights while the trainer ranks start and the warm start runs, unless disk sync must
        # first check that every engine sees the folder trainer rank 0 writes (one line before any engine loads).
        disk = cfg.rollout.resolved_weight_sync == "disk"
        self.loading = {} if disk else self._start_engines()
        self.trainer = TrainerGroup(cfg, ref, platform=platform)
        check_run_dir_shared(run_dir, self.trainer)
        self.weights = WeightSync(cfg, self.trainer, self.router, platform)
        self.weights.check(self.engines)
        if disk:
            self.loading = self._start_engines()
        self.reward_pool = self._reward_pool()
        self.managers = start_managers(cfg, ref, self.router, self.reward_pool)
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
        self.last_val: dict[str, float] = {}
        self.validation: asyncio.Task | None = None  # one under way, on the weights of the step it measures
        self.tasks: set[asyncio.Future] = set()
        self.log_failure = FirstOfKind("rollout")  # the env managers' logs stay in Ray's files; say it here
        self.fleet: dict[str, float] = {}  # the router's engine counts, logged with every step
        self.stop_signal: int | None = None  # SIGINT/SIGTERM received: stop at the next safe point
        self._batch_wait: asyncio.Future | None = None
        self.view = view or RunView(cfg.trainer.total_steps, show=cfg.logging.console)  # also the console sink
        self.sink = MetricsSink(
            run_dir,
            self.view,
            cfg.logging.jsonl,
            cfg.logging.tensorboard,
            cfg.logging.trackers,
            cfg.logging.project,
            cfg.name,
            cfg.model_dump(mode="json", by_alias=True),
        )
        self.trainer_lock = asyncio.Lock()  # the loop's trainer calls vs. a weight sync for a restarted engine

    def _reward_pool(self) -> Any:
        if not self.cfg.reward.functions:
            return None
        from agentrl.reward import RewardPool

        return RewardPool(self.cfg.reward, judge_router=self.router)

    def _start_engines(self) -> dict[ray.ObjectRef, int]:
        """Every engine starts loading its weights; the pipeline goes on (`engines_loaded` waits)."""
        return {engine.start.remote(): i for i, engine in enumerate(self.engines)}

    def engines_loaded(self, wait: bool = True) -> None:
        """An engine that failed to load ends the run in one line as soon as that is known; with `wait`, return
        once every engine has loaded its weights."""
        if not self.loading:
            return
        done, _ = ray.wait(list(self.loading), num_returns=len(self.loading), timeout=None if wait else 0)
        for ref in done:
            index = self.loading.pop(ref)
            try:
                ray.get(ref)
            except ray.exceptions.RayError as err:
                cause = getattr(err, "cause", None) or err
                why = " ".join(str(cause).split())
                raise ConfigError(
                    f"rollout engine {index} could not load {self.model_path}: {type(cause).__name__}: {why} "
                    "(rollout.* settings; --verbose shows the engines' own output)"
                ) from err

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
            result = Group(tag=tag, seed=seed, failures=[f"group {tag}/{seed}: {err}"] * admission.episodes)
        for failure in result.failures:
            episode, _, error = failure.partition(": ")
            self.log_failure(episode, error)
        await self.buffer.put(admission, result)
        self.tasks = {t for t in self.tasks if not t.done()}

    async def watch_engines(self, every_s: float = 2.0) -> None:
        """Print engine deaths and restarts as they happen; give an engine restarted between collective syncs
        the current weights at once (unless a step, whose own sync includes it, is under way); stop the run when
        no engine has been healthy for rollout.no_engine_timeout_s and none is being restarted (the trainer's
        wait for a batch raises RolloutStalled; a restart that never finishes times out in the router)."""
        timeout = self.cfg.rollout.no_engine_timeout_s
        while True:
            status = await self.router.fleet_status.remote()
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

    # ---- validation / warm start -----------------------------------------------------------------------------
    async def validate(self, step: int) -> dict[str, float]:
        """Held-out episodes on the engines' current weights (those of `step`), logged at that step."""
        episodes = len(self.cfg.envs.val or self.cfg.envs.train) * self.cfg.validation.episodes_per_tag
        with self.view.phase(f"validation at step {step}", episodes, "episodes") as tick:
            result = await evaluate(self.cfg, self.managers, tick)
        self.sink.log(step, result)
        if step == 0:
            self.state.first_val = result  # before RL
        return result

    def _start_validation(self) -> None:
        """Validate beside the next train step: the trainer's core would idle while the engines validate."""
        self.validation = asyncio.ensure_future(self.validate(self.state.step))

    async def _validation_done(self) -> None:
        """Wait for the validation under way (its failure raises here): engines keep the weights it measures until
        it ends. (An engine restarted meanwhile gets the trainer's newer weights; `watch_engines` cannot wait.)"""
        task, self.validation = self.validation, None
        if task is not None:
            self.last_val = await task

    def _drop_validation(self) -> None:
        """A stop or a stall cuts the validation under way short; a resume from that step runs it again."""
        if self.validation is not None:
            self.validation.cancel()
            self.validation = None

    async def warm_start(self) -> dict[str, float]:
        from transformers import AutoTokenizer

        from agentrl.warmstart import expert_samples

        if self.model_path == str(self.warm_cache):
            return {"sft/cached": 1.0, "sft/seconds": 0.0, "sft/samples": 0.0}
        sft = self.cfg.trainer.sft
        tokenizer = AutoTokenizer.from_pretrained(self.cfg.model.tokenizer or self.model_path)
        with self.view.phase("warm start: expert demos", sft.episodes, "episodes") as tick:
            demos = await asyncio.to_thread(expert_samples, self.cfg, tokenizer, sft.episodes, tick)
        t0, metrics = time.perf_counter(), {}
        with self.view.phase("warm start: SFT", sft.steps, "steps") as tick:
            for step in range(sft.steps):
                start = (step * sft.batch_size) % max(1, len(demos) - sft.batch_size)
                self.engines_loaded(wait=False)  # they load beside the warm start: a failure ends it at once
                metrics = await asyncio.to_thread(self.trainer.sft_step, demos[start : start + sft.batch_size])
                tick()
        if self.warm_cache is not None:
            await asyncio.to_thread(self._cache_warm_start, self.warm_cache)
        return {
            **metrics,
            "sft/seconds": time.perf_counter() - t0,
            "sft/samples": len(demos),
            "sft/failed_episodes": float(demos.failed_episodes),
        }

    def _cache_warm_start(self, path: Path) -> None:
        """Save the warm-started weights at `path`: trainer rank 0 writes them into a temporary folder and renames
        it into place on its own node (a concurrent run with the same key may have saved it first, and a reader
        never sees half a model). A driver on another node that does not see it says so: later runs reuse it only
        from a model.cache_dir every node shares."""
        self.trainer.save_warm_start(str(path))
        if not is_cached(path):
            print(
                f"agentrl: trainer.sft.cache: the warm start was saved at {path} on trainer rank 0's node, which "
                "this driver does not see: set model.cache_dir to a folder every node shares to reuse it",
                file=sys.stderr,
                flush=True,
            )

    # ---- the loop --------------------------------------------------------------------------------------------
    async def run(self, resume_from: Path | None) -> dict[str, float]:
        cfg, state = self.cfg, self.state
        self._handle_stop_signals()
        if resume_from is not None:
            snapshot = await asyncio.to_thread(load_run_state, resume_from, self.trainer, self.buffer)
            state = self.state = snapshot.state
            print(f"agentrl: {snapshot.describe()}", flush=True)
            self.trained_log.forget_after(state.step)
            await asyncio.to_thread(self.engines_loaded)
            await self.weights.sync(state.step)
            if self._validates(state.step):  # a stop may have cut that step's validation short
                self._start_validation()
        else:
            self.trained_log.forget_after(0)  # a run killed before its first checkpoint starts again from scratch
            warm = cfg.trainer.sft.enabled and cfg.trainer.sft.steps > 0
            if warm:
                self.sink.log(0, await self.warm_start())
            await asyncio.to_thread(self.engines_loaded)
            if warm:
                await self.weights.sync(0)
            if self._validates():
                self._start_validation()  # beside the first batch's rollout: the trainer would wait for it anyway
        background = [self._background(self.produce()), self._background(self.watch_engines())]
        self.view.start_steps(state.step)
        try:
            while state.step < cfg.trainer.total_steps and self.stop_signal is None:
                metrics = await self.train_step()
                if metrics is not None:
                    self.sink.log(state.step, metrics)
        except RolloutStalled:
            self._drop_validation()
            await self.save()  # resumable: the stall came before the next batch was taken
            raise
        finally:
            for task in background:
                task.cancel()
        if self.stop_signal is not None:
            self._drop_validation()
            await self.save()
            return {"first": state.first_val, "last": self.last_val}
        await self._validation_done()
        if self._validates() and not self._validates(state.step):
            self.last_val = await self.validate(state.step)
        await self.save()
        return {"first": state.first_val, "last": self.last_val}

    async def train_step(self) -> dict[str, float] | None:
        """One RL step: a batch from the buffer, a trainer step, the new weights to the engines, then
        validation and a checkpoint when due. None when a stop signal came while waiting for the batch."""
        state, metrics = self.state, {}
        t_step, stats_before = time.perf_counter(), replace(self.buffer.stats)
        with timed(metrics, "timing/rollout"):  # the trainer's wait for a batch
            groups = await self._next_batch()
        if groups is None:
            return None
        samples = [s for g in groups for s in g.samples]
        if self.cfg.logging.save_batches:
            await asyncio.to_thread(save_batch, batch_path(self.run_dir / "batches", state.step + 1), samples)
        metrics.update(batch_metrics(groups, samples, state.step))
        async with self.trainer_lock:
            with timed(metrics, "timing/train"):
                metrics.update(await asyncio.to_thread(self.trainer.train_step, samples))
            state.step += 1
            state.trained += len(groups)
            self.trained_log.record(state.step, groups)
            metrics["train/version"] = float(self.trainer.version)
        with timed(metrics, "timing/validation_wait"):  # the last step's validation, if it outlasted this step
            await self._validation_done()
        async with self.trainer_lock:
            with timed(metrics, "timing/weight_sync"):
                await self.weights.sync(state.step)
        await self.buffer.set_version(state.step)
        if self._validates(state.step):
            self._start_validation()
        if self.cfg.checkpoint.every_steps and state.step % self.cfg.checkpoint.every_steps == 0:
            await self.save()
        wall = time.perf_counter() - t_step
        tokens = sum(s.num_model_tokens for s in samples)
        metrics.update(self.buffer.stats.metrics_since(stats_before, wall))
        metrics.update(self.fleet)
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

    def _handle_stop_signals(self) -> None:
        """First SIGINT/SIGTERM: finish the step under way (or stop waiting for a batch), save, exit. A second one
        gets the default handling (exit at once)."""
        loop = asyncio.get_running_loop()

        def stop(sig: int) -> None:
            self.stop_signal = sig
            for s in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(s)
            if self._batch_wait is not None:
                self._batch_wait.cancel()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop, sig)

    async def save(self) -> Path:
        snapshot = Snapshot.take(self.state, self.buffer)  # one instant: taken before anything is awaited
        async with self.trainer_lock:
            return await asyncio.to_thread(
                save_run_state, self.run_dir, snapshot, self.trainer, self.cfg.checkpoint.keep_last
            )

    def close(self) -> None:
        self.sink.close()
        with contextlib.suppress(Exception):  # the writer's snapshots; a dead trainer took them with it
            self.weights.close()
        self.trainer.shutdown()
        for handle in [*self.managers, self.router, *self.engines]:
            ray.kill(handle)
        self.engines.remove_placement()


def check_run_dir_shared(run_dir: Path, trainer: TrainerGroup) -> None:
    """Every trainer rank writes its checkpoint shards under the run dir and the driver the run state beside
    them: on a cluster the folder must be one every rank's node sees, or a resume would find half a checkpoint."""
    run_dir.mkdir(parents=True, exist_ok=True)
    sentinel = run_dir / f".visible-{uuid.uuid4().hex[:8]}"
    sentinel.write_text("agentrl run dir check\n")
    try:
        blind = [str(r) for r, ok in enumerate(trainer.can_read(str(sentinel))) if not ok]
    finally:
        sentinel.unlink(missing_ok=True)
    if blind:
        raise ConfigError(
            f"run dir {run_dir} is not visible to trainer rank(s) {', '.join(blind)} (they run on another node): "
            "checkpoints need a logging.run_dir on a filesystem every node shares"
        )


def train(cfg: Config, resume: str | None = None, verbose: bool = False) -> int:
    """Run (or resume) a training run; ends with a summary table (held-out success before and after RL, where
    things are, how to resume). A stop signal or a stalled rollout saves a checkpoint and ends the run with one
    line saying how to resume it. verbose: Ray's start-up notices too."""
    t0 = time.perf_counter()
    configure_cpu_threads(1)
    run_dir = Path(resume or cfg.run_dir).absolute()  # actors get paths from here, whatever their working dir
    new_dir = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    resume_from = latest_checkpoint(run_dir) if (resume or cfg.checkpoint.resume == "auto") else None
    view = RunView(cfg.trainer.total_steps, show=cfg.logging.console)
    try:
        with view.starting(f"Ray, {cfg.rollout.num_engines} rollout engine(s), the trainer, env managers"):
            init_ray(cfg.ray_address, quiet=not verbose)
            pipeline = Pipeline(cfg, run_dir, view)
    except ConfigError:
        if new_dir:  # a run that never started leaves no folder behind
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    resume_hint = f"resume with: agentrl train {run_dir / 'config.yaml'} --resume {run_dir}"
    try:
        result = asyncio.run(pipeline.run(resume_from))
    except RolloutStalled as err:
        print(f"agentrl: stopped at step {pipeline.state.step}: {err}; {resume_hint}", file=sys.stderr)
        return 1
    finally:
        pipeline.close()
    if pipeline.stop_signal is not None:
        name = signal.Signals(pipeline.stop_signal).name
        print(f"agentrl: {name} at step {pipeline.state.step}: checkpoint saved; {resume_hint}", file=sys.stderr)
        return 128 + pipeline.stop_signal
    print_summary(run_summary(run_dir, result, pipeline.view, time.perf_counter() - t0, cfg.logging.tensorboard))
    return 0
