"""`agentrl train CFG [overrides]`: the main job."""

from __future__ import annotations

import argparse

from agentrl.config import load_config


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("train", parents=[common], help="train a policy with RL on the configured envs")
    p.add_argument("config", help="YAML file, e.g. examples/agentic_sokoban.yaml")
    p.add_argument("overrides", nargs="*", help="dotted.key=value or +new.key=value")
    p.add_argument("--resume", metavar="RUN_DIR", help="resume the run saved in RUN_DIR")
    p.set_defaults(func=_train)


def _train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)  # config mistakes first, before the slow imports
    from agentrl.memory_plan import check_memory_plan, plan_model_path
    from agentrl.run.preflight import check_before_ray

    check_before_ray(cfg, plan_model_path(cfg))  # platform vs. this machine, chat template: before Ray starts
    # A plan that cannot fit is refused here, before Ray starts any actor (see `agentrl plan`).
    check_memory_plan(cfg, plan_model_path(cfg))
    from agentrl.run.driver import train

    return train(cfg, resume=args.resume, verbose=getattr(args, "verbose", False))
