"""`agentrl rollout`, `agentrl eval` and `agentrl plot`: look at what a model does, without training."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from agentrl.cli import UsageError
from agentrl.config import load_config


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("rollout", parents=[common], help="collect episodes with the configured model (no training)")
    p.add_argument("config", help="YAML file or a packaged example's name")
    p.add_argument("overrides", nargs="*", help="dotted.key=value or +new.key=value")
    p.add_argument("--episodes", type=int, default=8, help="episodes to play")
    p.add_argument("--out", default="trajectories.jsonl", help="JSONL file: one episode a line (text, tokens, ...)")
    p.add_argument("--split", choices=["train", "val"], default="train", help="which envs and task seeds to play")
    p.set_defaults(func=_rollout)
    e = sub.add_parser("eval", parents=[common], help="held-out success and return per env tag")
    e.add_argument("config", help="YAML file or a packaged example's name")
    e.add_argument("overrides", nargs="*", help="dotted.key=value or +new.key=value")
    e.add_argument(
        "--checkpoint",
        help="a run dir (its latest checkpoint), a step dir (checkpoints/step-N or its trainer/) or a HF model dir",
    )
    e.set_defaults(func=_eval)
    pl = sub.add_parser("plot", parents=[common], help="write PNG curves of a run's metrics")
    pl.add_argument("run_dir", help="a run dir; writes RUN_DIR/curves.png")
    pl.set_defaults(func=_plot)


def _fleet(cfg, model_path: str, ref: str | None = None) -> list:
    """Engines, router and `envs.num_managers` env managers (the same wiring as `agentrl train`). `ref`: what the
    actors get instead of the local `model_path` (a hub id, which each resolves on its own node)."""
    from agentrl.envmanager.manager import start_managers
    from agentrl.platform import cluster_platform
    from agentrl.rollout.fleet import EngineSpec, start_engines, start_router
    from agentrl.run.preflight import check_before_ray
    from agentrl.run.startup import check_before_start, init_ray

    check_before_ray(cfg, model_path)
    init_ray(cfg.ray_address)
    platform = cluster_platform(cfg.platform)  # from the cluster's resources, not this (maybe GPU-less) node's
    check_before_start(cfg, model_path, platform)
    ref = ref or model_path
    engines = start_engines(EngineSpec(cfg.rollout, ref, cfg.seed), platform=platform)
    router = start_router(engines, cfg.rollout, restart=engines.factory)
    return start_managers(cfg, ref, router)


def _rollout(args: argparse.Namespace) -> int:
    from agentrl.envmanager.manager import episode_spec
    from agentrl.models.hub import model_ref
    from agentrl.models.tiny import resolve_model_path

    cfg = load_config(args.config, args.overrides)
    local = resolve_model_path(cfg.model.path, cfg.model.cache_dir, cfg.model.revision)
    managers = _fleet(cfg, local, model_ref(cfg.model.path, cfg.model.revision, local))
    envs = cfg.envs.val if args.split == "val" else cfg.envs.train
    tags = list(envs.items())
    specs = []
    for i in range(args.episodes):
        tag, env = tags[i % len(tags)]
        specs.append(episode_spec(cfg, args.split, tag, env.seed_start + i))

    async def collect():
        return await asyncio.gather(*(managers[i % len(managers)].run_episode.remote(s) for i, s in enumerate(specs)))

    episodes = asyncio.run(collect())
    with Path(args.out).open("w") as f:
        for ep in episodes:
            f.write(json.dumps(ep, default=str) + "\n")
    ok = [e for e in episodes if e["error"] is None]
    success = sum(e["metrics"].get("success", 0.0) for e in ok) / max(len(ok), 1)
    print(f"wrote {len(episodes)} episodes to {args.out}: success {success:.3f}, failed {len(episodes) - len(ok)}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from agentrl.envmanager.manager import evaluate
    from agentrl.models.hub import model_ref
    from agentrl.models.tiny import resolve_model_path

    cfg = load_config(args.config, args.overrides)
    if args.checkpoint:
        managers = _fleet(cfg, str(_checkpoint_model_dir(args.checkpoint)))
    else:
        local = resolve_model_path(cfg.model.path, cfg.model.cache_dir, cfg.model.revision)
        managers = _fleet(cfg, local, model_ref(cfg.model.path, cfg.model.revision, local))
    for key, value in sorted(asyncio.run(evaluate(cfg, managers)).metrics.items()):
        print(f"{key}: {value:.4f}")
    return 0


def _checkpoint_model_dir(path: str) -> Path:
    """The HF model dir `--checkpoint` names (a trainer checkpoint is exported next to itself first)."""
    from agentrl.run.checkpoint_paths import CheckpointPathError, hf_dir_for_eval, resolve_model_source

    try:
        source = resolve_model_source(path)
    except CheckpointPathError as err:
        raise UsageError(str(err)) from None
    model_dir = hf_dir_for_eval(source)
    if source.kind == "trainer":
        print(f"evaluating {source.path} (as the HF model dir {model_dir})")
    return model_dir


def _plot(args: argparse.Namespace) -> int:
    from agentrl.observe.metrics import plot_run

    print(plot_run(args.run_dir))
    return 0
