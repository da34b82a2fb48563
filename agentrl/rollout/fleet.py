"""Start the configured rollout engines as Ray actors and the router actor in front of them."""

from __future__ import annotations

import functools
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


def engine_kwargs(
    cfg: RolloutConfig, model_path: str, seed: int, index: int = 0, lora: LoraConfig | None = None
) -> dict[str, Any]:
    """The engine class's arguments; `lora`: the adapters it serves (vllm only)."""
    if cfg.backend == "remote":
        # rollout.url may list several servers, comma-separated: engine i talks to server i (round robin).
        urls = [u.strip() for u in (cfg.url or "").split(",") if u.strip()]
        return {"url": urls[index % len(urls)], "request_timeout_s": cfg.request_timeout_s, **cfg.engine_kwargs}
    return {"model_path": model_path, "cfg": cfg, "seed": seed, **({"lora": lora} if lora is not None else {})}


class Engines(list):
    """Engine handles as `create_engines` made them, remembering their platform and placement so that
    `start_router` re-creates a dead engine i in bundle i. A plain list works too (restarts are then unplaced)."""

    def __init__(self, handles: list[Any], platform: Platform, placement: Placement | None) -> None:
        super().__init__(handles)
        self.platform = platform
        self.placement = placement

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


def _create(
    cfg: RolloutConfig,
    model_path: str,
    seed: int,
    index: int = 0,
    platform: Platform | None = None,
    placement: Placement | None = None,
    lora: LoraConfig | None = None,
) -> Any:
    platform = platform or cluster_platform()
    return (
        ray.remote(engine_class(cfg.backend))
        .options(**engine_options(cfg, platform, placement, index))
        .remote(**engine_kwargs(cfg, model_path, seed, index, lora))
    )


def _create_at(
    cfg: RolloutConfig,
    model_path: str,
    seed: int,
    index: int,
    platform: Platform | None = None,
    placement: Placement | None = None,
    lora: LoraConfig | None = None,
) -> Any:
    return _create(cfg, model_path, seed + index, index, platform, placement, lora)


def engine_factory(
    cfg: RolloutConfig,
    model_path: str,
    seed: int = 0,
    platform: Platform | None = None,
    placement: Placement | None = None,
    lora: LoraConfig | None = None,
) -> EngineFactory:
    """Engine `index` made anew exactly as create_engines made it (not started), in bundle `index` of `placement`:
    the router's restart path. `platform` defaults to the one of the connected Ray cluster (`cluster_platform`)."""
    platform = platform or (placement.platform if placement is not None else cluster_platform())
    return functools.partial(_create_at, cfg, model_path, seed, platform=platform, placement=placement, lora=lora)


def create_engines(
    cfg: RolloutConfig,
    model_path: str,
    seed: int = 0,
    count: int | None = None,
    platform: Platform | None = None,
    lora: LoraConfig | None = None,
) -> Engines:
    """`count` (default rollout.num_engines) engine actors in their placement group, created but not started (no
    weights loaded yet): a caller can check things in between, then `start_created`. `lora`: the adapters the
    engines serve (trainer.lora with sync: adapter)."""
    platform = platform or cluster_platform()
    placement = engine_placement(cfg, platform, count)
    make = engine_factory(cfg, model_path, seed, platform, placement, lora)
    return Engines([make(i) for i in range(count or cfg.num_engines)], platform, placement)


def start_created(engines: list[Any]) -> list[Any]:
    """Start created engines in parallel (each loads its weights); returns them."""
    ray.get([h.start.remote() for h in engines])
    return engines


def start_engines(
    cfg: RolloutConfig,
    model_path: str,
    seed: int = 0,
    count: int | None = None,
    platform: Platform | None = None,
    lora: LoraConfig | None = None,
) -> Engines:
    """`count` (default rollout.num_engines) engine actors, started in parallel (weights loaded)."""
    return start_created(create_engines(cfg, model_path, seed, count, platform, lora))


def start_router(
    engines: list[Any],
    cfg: RolloutConfig,
    model_path: str | None = None,
    seed: int = 0,
    lora: LoraConfig | None = None,
    **health_overrides: Any,
) -> Any:
    """The router actor. With `model_path` (and the `seed` given to start_engines) it restarts a dead engine up to
    rollout.restart_engines times, in the dead engine's placement bundle when `engines` came from create_engines;
    without, dead engines are only drained and reported. `health_overrides`: HealthPolicy fields (tests)."""
    restart = None
    if model_path is not None:
        platform, placement = getattr(engines, "platform", None), getattr(engines, "placement", None)
        restart = engine_factory(cfg, model_path, seed, platform, placement, lora)
    health = HealthPolicy(**health_overrides)
    return (
        ray.remote(Router)
        .options(max_concurrency=100_000, num_cpus=0)
        .remote(list(engines), cfg, restart=restart, health=health)
    )
