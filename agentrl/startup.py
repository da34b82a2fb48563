"""What every command that starts engines and env managers does first, in one place: the Ray session the run's
workers share (user modules, the working directory) and the checks that fail in one line before anything slow
starts."""

from __future__ import annotations

import logging

from agentrl.config import Config, check_model_loads


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
    """Turn limits, the model and every configured env (built in a Ray worker, as the env managers will):
    ConfigError, one line, before any engine starts."""
    from agentrl.envmanager.manager import check_envs_in_actor, check_turn_limits

    check_turn_limits(cfg)
    check_model_loads(model_path)
    check_envs_in_actor(cfg)
