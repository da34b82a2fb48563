"""Start the configured rollout engines as Ray actors and the router actor in front of them."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import ray

from agentrl.config.schema import LoraConfig, RolloutConfig
from agentrl.models.hub import hub_env
from agentrl.placement import Placement, create_placement
from agentrl.platform import Platform, cluster_platform
from agentrl.rollout.health import EngineFactory, HealthPolicy
from agentrl.rollout.router import Router


def engine_class(backend: str) -> type:
    if backend == "vllm":
        from agentrl.rollout.vllm_engine import VLLMEngine

        return VLLMEngine
    if backend == "sglang":
        from agentrl.rollout.sglang_engine import SGLangEngine

        return SGLangEngine
    if backend == "remote":
        from agentrl.rollout.remote_engine import RemoteEngine

        return RemoteEngine
    raise ValueError(f"unknown rollout backend {backend!r}")


@dataclass(frozen=True)
class EngineSpec:
    """What every engine of a fleet is made from: a restart makes engine `index` again from the same spec."""

    cfg: RolloutConfig
    model_path: str
    seed: int = 0  # engine i samples with seed + i
    lora: LoraConfig | None = None  # the adapters the engines serve (trainer.lora with sync: adapter; vllm only)


def engine_kwargs(spec: EngineSpec, index: int = 0) -> dict[str, Any]:
    """Engine `index`'s constructor arguments."""
    cfg = spec.cfg
    if cfg.backend == "remote":
        # rollout.url may list several servers, comma-separated: engine i talks to server i (round robin).
        urls = [u.strip() for u in (cfg.url or "").split(",") if u.strip()]
        return {"url": urls[index % len(urls)], "request_timeout_s": cfg.request_timeout_s, **cfg.engine_kwargs}
    lora = {"lora": spec.lora} if spec.lora is not None else {}
    return {"model_path": spec.model_path, "cfg": cfg, "seed": spec.seed + index, **lora}


class Engines(list):
    """Engine handles as `create_engines` made them, with the factory that made them (engine i in bundle i of
    their placement), for `start_router(engines, cfg, restart=engines.factory)` to restart a dead one."""

    def __init__(self, handles: list[Any], placement: Placement | None, factory: EngineFactory) -> None:
        super().__init__(handles)
        self.placement = placement
        self.factory = factory

    def remove_placement(self) -> None:
        """Free the engines' device reservation once they are killed."""
        if self.placement is not None:
            self.placement.remove()


def engine_placement(
    cfg: RolloutConfig, platform: Platform, count: int | None = None, reserve: bool = True
) -> Placement:
    """Slots for `count` engines (default rollout.num_engines): tensor_parallel_size devices + rollout.ray_resources
    each; a remote engine (an HTTP client) needs nothing. `reserve`: create the placement group now."""
    n = count or cfg.num_engines
    if cfg.backend == "remote":
        return Placement(platform, 0, {}, n)
    if not reserve:
        return Placement(platform, cfg.tensor_parallel_size, dict(cfg.ray_resources), n)
    return create_placement(platform, cfg.tensor_parallel_size, cfg.ray_resources, n, name="rollout engines")


def engine_options(cfg: RolloutConfig, platform: Platform, placement: Placement | None, index: int) -> dict[str, Any]:
    """Ray actor options of engine `index`: its slot in `placement` (unplaced without one), and the environment
    that makes `detect()` inside the actor agree with the run's platform."""
    slot = placement or engine_placement(cfg, platform, reserve=False)
    env = (
        platform.actor_env()
        if cfg.backend == "remote"
        else {**platform.vllm_env(), **platform.actor_env(), **hub_env()}
    )
    return {"max_concurrency": 4096, **slot.options(index), "runtime_env": {"env_vars": env}}


def _create(spec: EngineSpec, index: int, platform: Platform, placement: Placement | None) -> Any:
    return (
        ray.remote(engine_class(spec.cfg.backend))
        .options(**engine_options(spec.cfg, platform, placement, index))
        .remote(**engine_kwargs(spec, index))
    )


def engine_factory(
    spec: EngineSpec, platform: Platform | None = None, placement: Placement | None = None
) -> EngineFactory:
    """Engine `index` made anew exactly as create_engines made it (not started), in bundle `index` of `placement`:
    the router's restart path. `platform` defaults to the one of the connected Ray cluster (`cluster_platform`)."""
    platform = platform or (placement.platform if placement is not None else cluster_platform())
    return functools.partial(_create, spec, platform=platform, placement=placement)


def create_engines(spec: EngineSpec, count: int | None = None, platform: Platform | None = None) -> Engines:
    """`count` (default rollout.num_engines) engine actors in their placement group, created but not started (no
    weights loaded yet): a caller can check things in between, then `start_created`."""
    platform = platform or cluster_platform()
    placement = engine_placement(spec.cfg, platform, count)
    make = engine_factory(spec, platform, placement)
    return Engines([make(i) for i in range(count or spec.cfg.num_engines)], placement, make)


def start_created(engines: list[Any]) -> list[Any]:
    """Start created engines in parallel (each loads its weights); returns them."""
    ray.get([h.start.remote() for h in engines])
    return engines


def start_engines(spec: EngineSpec, count: int | None = None, platform: Platform | None = None) -> Engines:
    """`count` (default rollout.num_engines) engine actors, started in parallel (weights loaded)."""
    return start_created(create_engines(spec, count, platform))


def start_router(
    engines: list[Any], cfg: RolloutConfig, restart: EngineFactory | None = None, **health_overrides: Any
) -> Any:
    """The router actor. With `restart` (`Engines.factory` of engines from create_engines, or any
    `engine_factory`) it restarts a dead engine up to rollout.restart_engines times, through that factory (in the
    dead engine's placement bundle for `Engines.factory`); without, dead engines are only drained and reported.
    `health_overrides`: HealthPolicy fields (tests)."""
    health = HealthPolicy(**health_overrides)
    return (
        ray.remote(Router)
        .options(max_concurrency=100_000, num_cpus=0)
        .remote(list(engines), cfg, restart=restart, health=health)
    )
