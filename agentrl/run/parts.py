"""The run's parts and their start-up, in one place: the checks that come before any actor, the rollout engines
and their router, the trainer ranks, weight sync, the reward pool and the env managers. `start_parts` builds the
real ones on Ray; the loop (`agentrl.run.loop`) only drives what it is given, so its own test passes fakes."""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from agentrl.config import Config, ConfigError
from agentrl.models.hub import model_ref
from agentrl.models.tiny import resolve_model_path
from agentrl.platform import cluster_platform
from agentrl.rollout.fleet import EngineSpec, create_engines, start_router
from agentrl.run.startup import check_before_start
from agentrl.run.warm_start import is_cached, warm_start_cache


class EngineLoading:
    """Engines loading their weights beside the rest of the start-up (and the warm start)."""

    def __init__(self, loads: dict[Any, int] | None = None, model_path: str = "") -> None:
        self.loads = loads or {}  # load ObjectRef -> engine index
        self.model_path = model_path

    def check(self, wait: bool = True) -> None:
        """An engine that failed to load ends the run in one line as soon as that is known; with `wait`, return
        once every engine has loaded its weights."""
        if not self.loads:
            return
        done, _ = ray.wait(list(self.loads), num_returns=len(self.loads), timeout=None if wait else 0)
        for ref in done:
            index = self.loads.pop(ref)
            try:
                ray.get(ref)
            except ray.exceptions.RayError as err:
                cause = getattr(err, "cause", None) or err
                why = " ".join(str(cause).split())
                raise ConfigError(
                    f"rollout engine {index} could not load {self.model_path}: {type(cause).__name__}: {why} "
                    "(rollout.* settings; --verbose shows the engines' own output)"
                ) from err


@dataclass
class RunParts:
    """What the loop drives. The trainer: `train_step`, `sft_step`, `version`, `save_checkpoint`,
    `load_checkpoint`, `save_warm_start`; weights: `sync(version)`; the router: `fleet_status`; each manager:
    `run_group(tag, seed[, split, n])`."""

    trainer: Any
    weights: Any
    router: Any
    managers: list[Any]
    engines: Any = ()  # the EngineSet: engine actor handles, killed (and their placement removed) at close
    model_path: str = ""  # what the warm start tokenizes with: the base model, or the cached warm start
    warm_cache: Path | None = None  # trainer.sft.cache: where the warm start is kept
    loading: EngineLoading = field(default_factory=EngineLoading)

    def close(self) -> None:
        with contextlib.suppress(Exception):  # the writer's snapshots; a dead trainer took them with it
            self.weights.close()
        self.trainer.shutdown()
        for handle in [*self.managers, self.router, *self.engines]:
            ray.kill(handle)
        self.engines.remove_placement()


def start_parts(cfg: Config, run_dir: Path) -> RunParts:
    """Check what can be checked before any actor starts, then start every actor of the run. Engines load their
    weights while the trainer ranks start and the warm start runs, unless disk sync must first check that every
    engine sees the folder trainer rank 0 writes (one line before any engine loads)."""
    from agentrl.envmanager.manager import start_managers
    from agentrl.run.weights import WeightSync
    from agentrl.trainer import TrainerGroup

    model_path = resolve_model_path(cfg.model.path, cfg.model.cache_dir, cfg.model.revision)
    # What actors get: a hub id stays one, resolved by each actor on its own node (a snapshot path is this one's)
    ref = model_ref(cfg.model.path, cfg.model.revision, model_path)
    warm_cache = warm_start_cache(cfg, model_path)
    if is_cached(warm_cache):  # an earlier run's warm start replaces the base weights and the SFT
        ref = model_path = str(warm_cache)
    platform = cluster_platform(cfg.platform)  # from the cluster's resources, not this (head) node's devices
    check_before_start(cfg, model_path, platform)
    lora = cfg.trainer.lora if cfg.trainer.lora is not None and cfg.trainer.lora.sync == "adapter" else None
    engines = create_engines(EngineSpec(cfg.rollout, ref, cfg.seed, lora), platform=platform)
    router = start_router(engines, cfg.rollout, restart=engines.factory)
    disk = cfg.rollout.resolved_weight_sync == "disk"

    def load() -> EngineLoading:
        return EngineLoading({engine.start.remote(): i for i, engine in enumerate(engines)}, model_path)

    loading = EngineLoading() if disk else load()
    trainer = TrainerGroup(cfg, ref, platform=platform)
    check_run_dir_shared(run_dir, trainer)
    weights = WeightSync(cfg, trainer, router, platform)
    weights.check(engines)
    if disk:
        loading = load()
    managers = start_managers(cfg, ref, router, _reward_pool(cfg, router))
    return RunParts(trainer, weights, router, managers, engines, model_path, warm_cache, loading)


def _reward_pool(cfg: Config, router: Any) -> Any:
    if not cfg.reward.functions:
        return None
    from agentrl.reward import RewardPool

    return RewardPool(cfg.reward, judge_router=router)


def check_run_dir_shared(run_dir: Path, trainer: Any) -> None:
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
