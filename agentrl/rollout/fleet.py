"""Start the configured rollout engines as Ray actors and the router actor in front of them."""

from __future__ import annotations

import functools
from typing import Any

import ray

from agentrl.config.schema import RolloutConfig
from agentrl.platform import detect
from agentrl.rollout.router import EngineFactory, Router


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


def engine_kwargs(cfg: RolloutConfig, model_path: str, seed: int, index: int = 0) -> dict[str, Any]:
    if cfg.backend == "remote":
        # rollout.url may list several servers, comma-separated: engine i talks to server i (round robin).
        urls = [u.strip() for u in (cfg.url or "").split(",") if u.strip()]
        return {"url": urls[index % len(urls)], "request_timeout_s": cfg.request_timeout_s, **cfg.engine_kwargs}
    return {
        "model_path": model_path,
        "max_model_len": cfg.max_model_len,
        "kv_cache_gib": cfg.kv_cache_gib,
        "enforce_eager": cfg.enforce_eager,
        "seed": seed,
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "engine_kwargs": dict(cfg.engine_kwargs),
    }


def _create(cfg: RolloutConfig, model_path: str, seed: int, index: int = 0) -> Any:
    platform = detect()
    # A remote engine is an HTTP client: it needs no accelerator and no vLLM environment.
    options = (
        {"num_cpus": 0}
        if cfg.backend == "remote"
        else {"runtime_env": {"env_vars": platform.vllm_env(cfg.kv_cache_gib)}, **platform.ray_actor_options()}
    )
    return (
        ray.remote(engine_class(cfg.backend))
        .options(max_concurrency=4096, **options)
        .remote(**engine_kwargs(cfg, model_path, seed, index))
    )


def _create_at(cfg: RolloutConfig, model_path: str, seed: int, index: int) -> Any:
    return _create(cfg, model_path, seed + index, index)


def engine_factory(cfg: RolloutConfig, model_path: str, seed: int = 0) -> EngineFactory:
    """Engine `index` made anew exactly as start_engines made it (not started): the router's restart path."""
    return functools.partial(_create_at, cfg, model_path, seed)


def start_engines(cfg: RolloutConfig, model_path: str, seed: int = 0, count: int | None = None) -> list[Any]:
    """`count` (default rollout.num_engines) engine actors, started in parallel (weights loaded)."""
    make = engine_factory(cfg, model_path, seed)
    handles = [make(i) for i in range(count or cfg.num_engines)]
    ray.get([h.start.remote() for h in handles])
    return handles


def start_router(
    engines: list[Any], cfg: RolloutConfig, model_path: str | None = None, seed: int = 0, **router_kwargs: Any
) -> Any:
    """The router actor. With `model_path` (and the `seed` given to start_engines) it restarts a dead engine up to
    rollout.restart_engines times; without, dead engines are only drained and reported."""
    restart = engine_factory(cfg, model_path, seed) if model_path is not None else None
    return (
        ray.remote(Router)
        .options(max_concurrency=100_000, num_cpus=0)
        .remote(
            engines,
            request_timeout_s=cfg.request_timeout_s,
            restart=restart,
            max_restarts=cfg.restart_engines,
            **router_kwargs,
        )
    )
