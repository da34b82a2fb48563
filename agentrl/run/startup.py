"""What every command that starts engines and env managers does first, in one place: the Ray session the run's
workers share (user modules, the working directory) and the checks that fail in one line before anything slow
starts."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from agentrl.config import Config, ConfigError, check_model_loads
from agentrl.platform import Platform, cluster_platform, platform_choice, run_platform
from agentrl.run.preflight import check_chat_template, platform_fix


def _fmt(x: float) -> str:
    return f"{x:g}"


def _fits(node: Mapping[str, float], need: Mapping[str, float]) -> int:
    """How many actors asking for `need` one node holds."""
    return min(int(node.get(k, 0.0) / v + 1e-9) for k, v in need.items()) if need else 1 << 30


def check_cluster_resources(
    cfg: Config,
    platform: Platform | None = None,
    cluster: Mapping[str, float] | None = None,
    nodes: list[Mapping[str, float]] | None = None,
) -> None:
    """Everything the run asks Ray for (each engine: tensor_parallel_size devices + rollout.ray_resources on one node;
    each trainer rank: 1 device + trainer.ray_resources) against the cluster's totals and its nodes: more than it
    has would leave the actors pending forever, without a word. `cluster` / `nodes` (alive nodes' resources) default
    to the connected Ray cluster's; `platform` to `cluster_platform(cfg.platform)`."""
    from agentrl.placement import bundle

    if cluster is None or nodes is None:
        import ray

        cluster = ray.cluster_resources() if cluster is None else cluster
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")] if nodes is None else nodes
    if platform is None:
        platform = run_platform(platform_choice(cfg.platform), cluster)
    ro, tr = cfg.rollout, cfg.trainer
    engines = 0 if ro.backend == "remote" else ro.num_engines
    tp = ro.tensor_parallel_size
    kinds: Kinds = [
        ("rollout engine", engines, bundle(platform, tp, ro.ray_resources), "rollout"),
        ("trainer rank", tr.num_ranks, bundle(platform, 1, tr.ray_resources), "trainer"),
    ]
    device = platform.ray_resource if platform.is_accelerator else None
    _check_totals(cfg, platform, kinds, device, cluster)
    _check_nodes(kinds, device, nodes)


Kinds = list[tuple[str, int, dict[str, float], str]]  # (what, count, one actor's bundle, the setting that sized it)


def _check_totals(cfg: Config, platform: Platform, kinds: Kinds, device: str | None, cluster: Mapping) -> None:
    """The cluster holds every resource the run asks for, in total; else one line naming the setting to change."""
    (_, engines, _, _), (_, ranks, _, _) = kinds
    tp = cfg.rollout.tensor_parallel_size
    problems: list[str] = []
    hints: dict[str, None] = {}
    for key in dict.fromkeys(k for _, count, b, _ in kinds if count for k in b):
        need = sum(count * b.get(key, 0.0) for _, count, b, _ in kinds)
        have = cluster.get(key, 0.0)
        if need <= have + 1e-9:
            continue
        if key == device:
            why = f"{engines} rollout engines x {tp} + {ranks} trainer ranks"
            lower = "lower rollout.num_engines, rollout.tensor_parallel_size or trainer.num_ranks"
            # no such device at all: the platform, not the counts, is the likely mistake
            hints[f"{platform_fix(cfg)}, or {lower}" if have == 0 else lower] = None
        else:
            hints["change rollout.ray_resources / trainer.ray_resources"] = None
            why = " + ".join(
                f"{count} {what}s x {_fmt(b[key])} from {section}.ray_resources"
                for what, count, b, section in kinds
                if count and key in b
            )
        problems.append(f"{_fmt(need)} {key} ({why}) and the Ray cluster has {_fmt(have)}")
    if problems:
        raise ConfigError(
            f"the run needs {'; '.join(problems)}: {' or '.join(hints)}, or add nodes with these resources"
        )


def _check_nodes(kinds: Kinds, device: str | None, nodes: list[Mapping[str, float]]) -> None:
    """Each actor's bundle fits on one node, as many times as the run asks for it."""
    for what, count, need, section in kinds:
        if not count or not need:
            continue
        room = sum(_fits(node, need) for node in nodes)
        if room >= count:
            continue
        shown = ", ".join(f"{_fmt(v)} {k}" for k, v in need.items())
        setting = (
            "rollout.tensor_parallel_size" if section == "rollout" and device in need else f"{section}.ray_resources"
        )
        raise ConfigError(
            f"each {what} needs {shown} on one node and the Ray cluster's nodes hold {room} such "
            f"{what}{'' if room == 1 else 's'} of the {count} the run asks for: lower {setting} or "
            f"{'rollout.num_engines' if section == 'rollout' else 'trainer.num_ranks'}, or add nodes"
        )


NO_PRESTARTED_WORKERS = ("RAY_prestart_worker_first_driver", "0")  # Ray's setting, read by a raylet at its start


def init_ray(address: str | None, quiet: bool = True) -> None:
    """Join or start Ray (once per process), handing every worker the run's user modules. quiet: without Ray's
    start-up notices (`--verbose` shows them)."""
    import ray

    from agentrl.plugins import ray_runtime_env

    if ray.is_initialized():
        return
    # Ray's notice that its local cluster uses token authentication says nothing a user must act on.
    if quiet:
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    # A Ray that this call starts prestarts one idle worker per CPU for the job's runtime env. Every agentrl actor
    # and task carries its own env_vars (thread caps, platform), so Ray starts a worker of its own for each and the
    # prestarted ones only cost a Ray import each (2 of 3 idle workers after a run here; one per core on a big
    # node). The raylet reads this at its start: a cluster this call joins keeps its own setting.
    os.environ.setdefault(*NO_PRESTARTED_WORKERS)
    ray.init(
        address=address,
        runtime_env=ray_runtime_env(),
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )


def check_trainer_backend(cfg: Config, platform: Platform) -> None:
    """trainer.backend=megatron: its package is installed, and the trainer ranks have GPUs. Megatron-Core calls CUDA
    in many places that no setting turns off; on CPU only agentrl's own tests run it, with a compatibility layer
    that maps those calls to the CPU in the trainer ranks (they say so with AGENTRL_MEGATRON_CPU_SHIM=1)."""
    if cfg.trainer.backend != "megatron":
        return
    import importlib.util

    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("mbridge") is None:
        raise ConfigError("trainer.backend=megatron needs Megatron-Core and mbridge: pip install 'agentrl[megatron]'")
    if platform.kind == "npu":  # Megatron on Ascend goes through MindSpeed's patches, which agentrl lacks
        raise ConfigError("trainer.backend=megatron runs on CUDA GPUs only: use trainer.backend=fsdp2 on Ascend NPUs")
    if platform.kind == "cpu" and os.environ.get("AGENTRL_MEGATRON_CPU_SHIM") != "1":
        raise ConfigError(
            "trainer.backend=megatron needs CUDA GPUs for the trainer ranks and this run has none: "
            "use trainer.backend=fsdp2 on CPU"
        )


def check_before_start(cfg: Config, model_path: str, platform: Platform | None = None) -> None:
    """Ray resources (devices and custom ones, in total and per node), turn limits, the model and every configured
    env (built in a Ray worker, as the env managers will): ConfigError, one line, before any engine starts.
    `platform`: the run's (default: from cfg.platform and the cluster's resources)."""
    from agentrl.envmanager.manager import check_envs_in_actor, check_turn_limits

    check_cluster_resources(cfg, platform)
    check_trainer_backend(cfg, platform or cluster_platform(cfg.platform))
    check_turn_limits(cfg)
    check_model_loads(model_path)
    check_chat_template(cfg, model_path)
    check_envs_in_actor(cfg)
