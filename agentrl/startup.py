"""What every command that starts engines and env managers does first, in one place: the Ray session the run's
workers share (user modules, the working directory) and the checks that fail in one line before anything slow
starts."""

from __future__ import annotations

import logging

from agentrl.config import Config, ConfigError, check_model_loads


def check_cluster_devices(cfg: Config) -> None:
    """The accelerators the run asks Ray for (one per engine and per trainer rank) against what the cluster has:
    more than it has would leave the actors pending forever, without a word."""
    import ray

    from agentrl.platform import detect

    platform = detect()
    if not platform.is_accelerator:
        return
    key = "GPU" if platform.kind == "cuda" else platform.ray_resource
    engines = 0 if cfg.rollout.backend == "remote" else cfg.rollout.num_engines
    need, have = engines + cfg.trainer.num_ranks, ray.cluster_resources().get(key, 0)
    if need > have:
        raise ConfigError(
            f"the run needs {need} {key} ({engines} rollout engines + {cfg.trainer.num_ranks} trainer ranks) and "
            f"the Ray cluster has {have:g}: lower rollout.num_engines or trainer.num_ranks, or add nodes"
        )


def init_ray(address: str | None) -> None:
    """Join or start Ray (once per process), handing every worker the run's user modules."""
    import ray

    from agentrl.plugins import ray_runtime_env

    if ray.is_initialized():
        return
    # Ray's notice that its local cluster uses token authentication says nothing a user must act on.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    ray.init(
        address=address,
        runtime_env=ray_runtime_env(),
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )


def check_before_start(cfg: Config, model_path: str) -> None:
    """Devices, turn limits, the model and every configured env (built in a Ray worker, as the env managers
    will): ConfigError, one line, before any engine starts."""
    from agentrl.envmanager.manager import check_envs_in_actor, check_turn_limits

    check_cluster_devices(cfg)
    check_turn_limits(cfg)
    check_model_loads(model_path)
    check_envs_in_actor(cfg)
