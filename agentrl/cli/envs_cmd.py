"""`agentrl envs` lists registered envs with their kwargs; `agentrl check-env ID [key=value ...]` checks one.

`agentrl check-env http://HOST:PORT [env=ID token_env=VAR ...]` checks an env served over the OpenEnv protocol
(e.g. by `agentrl serve-envs`), through the agentrl/OpenEnv-v0 adapter: the same checks and episodes.

Envs defined in your own module are loaded with `--import my_pkg.my_env` (the module calls
`agentrl.register_env`). check-env exits 1 and names each contract violation; usage mistakes exit 2.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from typing import Any

from agentrl.cli import UsageError


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("envs", parents=[common], help="list registered envs with their kwargs and defaults")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_list)
    c = sub.add_parser(
        "check-env",
        parents=[common],
        help="check an env (gymnasium checker + text-env contract) and play random/expert episodes",
    )
    c.add_argument("env_id", help="registered env id, e.g. agentrl/SimpleSokoban-v0, or an OpenEnv server URL")
    c.add_argument("kwargs", nargs="*", help="env kwargs as key=value (values are Python literals or plain text)")
    c.add_argument("--episodes", type=int, default=20, help="episodes per agent (default 20)")
    c.add_argument("--seed", type=int, default=0, help="first episode seed (default 0)")
    c.add_argument(
        "--timeout-s", type=float, default=30.0, help="limit of each env call, as envs.call_timeout_s (default 30)"
    )
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.add_argument(
        "--agent",
        metavar="MODULE:FN",
        help="play the env with this agent program through the gateway, the env's expert answering for the model "
        "(the agent's plumbing: prompts, tool format, rewards); `agentrl rollout` plays it with a model",
    )
    c.set_defaults(func=_check)


REMOTE_SCHEMES = ("http://", "https://", "ws://", "wss://")
REMOTE_ENV_ID = "agentrl/OpenEnv-v0"


def parse_kwargs(items: list[str]) -> dict[str, Any]:
    """key=value pairs; values are Python literals ((8, 8), 0.5, True) or else plain strings."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"expected key=value, got {item!r}")
        lowered = {"true": True, "false": False, "none": None, "null": None}
        try:
            value = lowered[raw.lower()] if raw.lower() in lowered else ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        out[key.strip()] = value
    return out


def _list(args: argparse.Namespace) -> int:
    from agentrl.envs import env_kwargs, registered_env_ids
    from agentrl.envs.libraries import library_env_ids

    library_env_ids()  # the installed libraries' envs too (reasoning_gym/..., registered on demand elsewhere)
    table = {env_id: env_kwargs(env_id) for env_id in registered_env_ids()}
    if args.json:
        print(json.dumps(table, indent=2, default=repr))
        return 0
    for env_id, kwargs in table.items():
        print(env_id)
        print("    " + " ".join(f"{k}={v!r}" for k, v in kwargs.items()))
    return 0


def _check(args: argparse.Namespace) -> int:
    from agentrl.envs import UnknownEnvError, env_kwargs
    from agentrl.envs.checker import check_text_env
    from agentrl.envs.libraries import MissingLibraryError

    kwargs = parse_kwargs(args.kwargs)
    if args.env_id.startswith(REMOTE_SCHEMES):  # a server: check it through the OpenEnv adapter
        kwargs = {"url": args.env_id, **kwargs}
        args.env_id = REMOTE_ENV_ID
    if args.agent:
        return _check_agent(args, kwargs)
    if args.env_id.startswith("verifiers/"):
        return _check_verifiers(args, kwargs)
    try:
        known = env_kwargs(args.env_id)
        unknown = sorted(set(kwargs) - set(known))
        if unknown and "**kwargs" not in known:
            raise UsageError(f"{args.env_id} has no kwarg(s) {unknown}; it accepts: {', '.join(known)}")
        report = check_text_env(args.env_id, kwargs, episodes=args.episodes, seed=args.seed, timeout_s=args.timeout_s)
    except (UnknownEnvError, MissingLibraryError) as err:
        raise UsageError(str(err)) from None
    except (TypeError, ValueError) as err:  # raised while building the env: bad kwargs or values
        raise UsageError(f"cannot build {args.env_id} with {kwargs}: {err}") from None
    if args.json:
        print(json.dumps(report, indent=2, default=repr))
    else:
        _print_report(report)
    for problem in report.get("warnings", []):
        print(f"agentrl check-env: warning {args.env_id}: {problem}", file=sys.stderr)
    for problem in report["violations"]:
        print(f"agentrl check-env: FAIL {args.env_id}: {problem}", file=sys.stderr)
    return 0 if report["ok"] else 1


def _check_verifiers(args: argparse.Namespace, kwargs: dict[str, Any]) -> int:
    """A verifiers env plays its own episodes (verifiers' rollout through the gateway, scored by its rubric), so
    there is no move to check here: it must load in its virtualenv and give the same task for the same seed."""
    from agentrl.envs import make_env
    from agentrl.envs.verifiers_env import VerifiersError

    seeds = range(args.seed, args.seed + args.episodes)
    try:
        env = make_env(args.env_id, **kwargs)
        first, again = [env.reset(seed=s) for s in seeds], [env.reset(seed=s) for s in seeds]
    except VerifiersError as err:
        print(f"agentrl check-env: FAIL {args.env_id}: {err}", file=sys.stderr)
        return 1
    except TypeError as err:
        raise UsageError(f"cannot build {args.env_id} with {kwargs}: {err}") from None
    problems = []
    for s, reset, repeated in zip(seeds, first, again, strict=True):
        if reset != repeated:
            problems.append(f"reset(seed={s}) gave another task the second time")
        if not reset[0]:
            problems.append(f"reset(seed={s}) gave an empty prompt")
    tasks = env.worker.examples
    print(f"{args.env_id}: {'FAILED' if problems else 'OK'}  ({tasks['train']} train / {tasks['eval']} eval tasks;")
    print("  its episodes are verifiers' own rollouts through the gateway: `agentrl rollout` plays them with a model)")
    for problem in problems:
        print(f"agentrl check-env: FAIL {args.env_id}: {problem}", file=sys.stderr)
    return 1 if problems else 0


def _print_report(report: dict) -> None:
    print(f"{report['env']}: {'OK' if report['ok'] else 'FAILED'}")
    for agent in ("random", "expert"):
        stats = report.get(agent)
        if stats is None:
            print(f"  {agent:<6}  (none)" if agent in report else "")
            continue
        print(
            f"  {agent:<6}  success {stats['success_rate']:.1%}  mean turns {stats['mean_turns']:.2f}  "
            f"mean return {stats['mean_return']:.3f}  steps/s {stats['steps_per_s'] or 0:,.0f}  "
            f"reset {stats['reset_ms']:.3f} ms  ({stats['episodes']} episodes)"
        )


def _check_agent(args: argparse.Namespace, kwargs: dict[str, Any]) -> int:
    """Play `--episodes` episodes with the agent program, the env's expert answering in the model's place."""
    import asyncio

    from agentrl.config import ConfigError, load_config
    from agentrl.gateway.agents import UnknownAgentError, resolve_agent

    try:
        resolve_agent(args.agent)
        cfg = load_config(None, [f"envs.call_timeout_s={args.timeout_s}", "trainer.sft.expert_noise=0"])
        cfg.envs.train = {"check": {"env_id": args.env_id, "agent": args.agent, "kwargs": kwargs}}
    except (UnknownAgentError, ConfigError, ValueError) as err:
        raise UsageError(str(err)) from None
    report = asyncio.run(_play_agent(cfg, args))
    if args.json:
        print(json.dumps(report, indent=2, default=repr))
    else:
        print(f"{args.env_id} with agent {args.agent}: {'OK' if report['ok'] else 'FAILED'}")
        print(
            f"  expert through the agent  success {report['success_rate']:.1%}  mean turns {report['mean_turns']:.2f}  "
            f"mean return {report['mean_return']:.3f}  ({report['episodes']} episodes, {report['failed']} failed)"
        )
    for problem in report["violations"]:
        print(f"agentrl check-env: FAIL {args.env_id} with agent {args.agent}: {problem}", file=sys.stderr)
    return 0 if report["ok"] else 1


async def _play_agent(cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from agentrl.envmanager.manager import build_toolboxes
    from agentrl.gateway.demos import AgentDemos
    from agentrl.models.tiny import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or resolve_model_path(cfg.model.path))
    boxes = build_toolboxes(cfg, splits=("train",))
    demos = AgentDemos(cfg, tokenizer, boxes, noise_seed=1)
    spec = cfg.envs.train["check"]
    played, errors = [], []
    await demos.start()
    try:
        for i in range(args.episodes):
            try:
                played.append(await demos.episode("check", spec, args.seed + i, i))
            except Exception as err:
                errors.append(f"episode {args.seed + i}: {type(err).__name__}: {err}")
    finally:
        await demos.aclose()
        for box in boxes.values():
            await box.aclose()
    n = max(len(played), 1)
    violations = errors[:3] + ([f"... and {len(errors) - 3} more failed episodes"] if len(errors) > 3 else [])
    return {
        "env": args.env_id,
        "agent": args.agent,
        "ok": not errors,
        "episodes": len(played) + len(errors),
        "failed": len(errors),
        "success_rate": sum(ep.metrics.get("success", 0.0) for ep in played) / n,
        "mean_turns": sum(len(ep.turns) for ep in played) / n,
        "mean_return": sum(ep.env_return for ep in played) / n,
        "violations": violations,
    }
