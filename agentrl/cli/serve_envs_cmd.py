"""`agentrl serve-envs ENV_ID... --host 127.0.0.1 --port N [--env-kwargs ENV_ID=JSON] [--token-env VAR]
[--workers N]`: serve registered envs over the OpenEnv protocol (WebSocket sessions at /ws; `?env_id=` picks one
when several are served). `--env-kwargs` gives a served env its constructor kwargs, as `envs.*.kwargs` would."""

from __future__ import annotations

import argparse
import json

from agentrl.cli import UsageError
from agentrl.cli.server_args import add_bind_args, bearer_token


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("serve-envs", parents=[common], help="serve registered envs over the OpenEnv protocol")
    p.add_argument("env_ids", nargs="+", metavar="ENV_ID", help="registered env ids; the first is the default")
    add_bind_args(p, default_port=8810)
    p.add_argument(
        "--env-kwargs",
        action="append",
        default=[],
        metavar="ENV_ID=JSON",
        help="""constructor kwargs of a served env, e.g. 'agentrl/SimpleSokoban-v0={"mark_revisits": true}'""",
    )
    p.add_argument("--workers", type=int, default=1, help="worker processes behind the port (SO_REUSEPORT)")
    p.add_argument("--max-worker-rss-mb", type=float, default=0.0, help="recycle a worker past this RSS (0: never)")
    p.add_argument("--max-sessions", type=int, default=512, help="open sessions per worker before 503")
    p.add_argument("--max-concurrency", type=int, default=32, help="env calls running at once per worker")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger bodies/messages are refused (413)")
    p.add_argument("--idle-timeout-s", type=float, default=300.0, help="close sessions silent this long")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from agentrl.addresses import is_loopback
    from agentrl.envs import UnknownEnvError, make_env
    from agentrl.envserve.server import EnvServerLimits
    from agentrl.envserve.workers import PoolConfig, WorkerPool
    from agentrl.tools.serve import check_port

    token = bearer_token(args)
    if token is None and not is_loopback(args.host):
        raise UsageError(
            f"refusing to serve envs on {args.host} without auth: pass --token-env VAR (bearer token in $VAR) "
            "or bind to 127.0.0.1"
        )
    if not 0 < args.port < 65536:
        raise UsageError(f"--port {args.port}: must be 1-65535")
    for flag in ("workers", "max_sessions", "max_concurrency", "max_body_bytes"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1")
    if args.idle_timeout_s <= 0 or args.max_worker_rss_mb < 0:
        raise UsageError("--idle-timeout-s must be > 0 and --max-worker-rss-mb >= 0")
    env_kwargs = _env_kwargs(args.env_kwargs, args.env_ids)
    for env_id in args.env_ids:  # a typo is one line now, not a worker crash loop
        try:
            make_env(env_id, **env_kwargs.get(env_id, {})).close()
        except UnknownEnvError as err:
            raise UsageError(str(err)) from None
        except (TypeError, ValueError) as err:
            raise UsageError(f"--env-kwargs for {env_id}: {err}") from None
    try:
        check_port(args.host, args.port)
    except ValueError as err:
        raise UsageError(str(err)) from None
    limits = EnvServerLimits(
        max_sessions=args.max_sessions,
        max_concurrency=args.max_concurrency,
        max_body_bytes=args.max_body_bytes,
        idle_timeout_s=args.idle_timeout_s,
    )
    cfg = PoolConfig(
        env_ids=list(args.env_ids),
        env_kwargs=env_kwargs,
        host=args.host,
        port=args.port,
        token=token,
        workers=args.workers,
        max_worker_rss_mb=args.max_worker_rss_mb,
        limits=limits,
        imports=list(getattr(args, "imports", None) or []),
    )
    WorkerPool(cfg).run()
    return 0


def _env_kwargs(items: list[str], env_ids: list[str]) -> dict[str, dict]:
    """`ENV_ID=JSON` flags as {env_id: kwargs}, for served env ids only."""
    out: dict[str, dict] = {}
    for item in items:
        env_id, sep, text = item.partition("=")
        if not sep:
            raise UsageError(f"--env-kwargs {item!r}: expected ENV_ID=JSON")
        if env_id not in env_ids:
            raise UsageError(f"--env-kwargs {item!r}: {env_id} is not served here (served: {', '.join(env_ids)})")
        try:
            kwargs = json.loads(text)
        except json.JSONDecodeError as err:
            raise UsageError(f"--env-kwargs for {env_id}: not JSON ({err})") from None
        if not isinstance(kwargs, dict):
            raise UsageError(f"--env-kwargs for {env_id}: expected a JSON object, got {text}")
        out[env_id] = {**out.get(env_id, {}), **kwargs}
    return out
