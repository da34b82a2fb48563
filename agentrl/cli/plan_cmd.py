"""`agentrl plan CFG [overrides] [--device-memory 80GiB]`: estimated memory per trainer rank and engine."""

from __future__ import annotations

import argparse

from agentrl.config import load_config


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "plan",
        parents=[common],
        help="estimate memory per trainer rank and rollout engine, against the device, before launch",
    )
    p.add_argument("config", help="YAML file, e.g. examples/sokoban_cluster.yaml")
    p.add_argument("overrides", nargs="*", help="dotted.key=value or +new.key=value")
    p.add_argument(
        "--device-memory",
        metavar="SIZE",
        help="memory of one device, e.g. 80GiB (default: detected; host RAM on CPU); on a machine without an "
        "accelerator this plans for one (bf16, checkpointing on for `auto`) unless --platform cpu",
    )
    p.add_argument("--platform", choices=["cpu", "cuda", "npu"], help="plan for this platform (default: detected)")
    p.add_argument("--params", metavar="N", help="parameter count (e.g. 7B) for a hub model not available offline")
    p.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    from agentrl import memory_plan as mp
    from agentrl.cli import UsageError

    cfg = load_config(args.config, args.overrides)
    dims = mp.load_dims(mp.plan_model_path(cfg), args.params)
    from agentrl.platform import detect

    detected = detect().kind
    kind = args.platform or ("cuda" if detected == "cpu" and args.device_memory else detected)
    if args.device_memory:
        mem, source = mp.parse_bytes(args.device_memory), "--device-memory"
    elif kind == detected:
        mem, source = mp.device_memory(kind)
    else:
        raise UsageError(f"planning for {kind} on a machine without one needs --device-memory SIZE")
    plan = mp.make_plan(cfg, dims, kind, mem, source)
    _print(plan)
    return 1 if plan.problems else 0


def _print(plan) -> None:
    from rich.console import Console
    from rich.table import Table

    from agentrl.memory_plan import GiB, count

    d = plan.dims
    console = Console(highlight=False)
    console.print(
        f"model {d.name}: {count(d.params)} params, {d.layers} layers, hidden {d.hidden}, vocab {d.vocab} ({d.source})"
    )
    console.print(
        f"platform {plan.platform}, {plan.device_bytes / GiB:.1f} GiB per device ({plan.device_source}); "
        + ", ".join(f"{k} {v}" for k, v in plan.settings.items())
    )
    for actor in (plan.trainer, plan.engine):
        if actor is None:
            continue
        table = Table(title=f"per {actor.role} (x{actor.count})", title_justify="left")
        table.add_column("component")
        table.add_column("GiB", justify="right")
        table.add_column("how")
        for c in actor.components:
            table.add_row(c.name, f"{c.bytes / GiB:.2f}", c.how)
        table.add_row("total", f"{actor.total / GiB:.2f}", "", style="bold")
        console.print(table)
    if plan.shared_host:
        console.print(f"all processes share host RAM: {plan.host_total / GiB:.1f} of {plan.device_bytes / GiB:.1f} GiB")
    for line in plan.problems:
        console.print(f"[bold red]does not fit:[/] {line}")
    if not plan.problems:
        console.print("fits")
