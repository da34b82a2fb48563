"""`agentrl serve-envs ENV_ID... --host 127.0.0.1 --port N [--token-env VAR] [--workers N]`: serve registered envs
over the OpenEnv protocol (WebSocket sessions at /ws; `?env_id=` picks one when several are served)."""

from __future__ import annotations

import argparse

from agentrl.cli import UsageError
from agentrl.cli.server_args import add_bind_args, bearer_token


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("serve-envs", parents=[common], help="serve registered envs over the OpenEnv protocol")
    p.add_argument("env_ids", nargs="+", metavar="ENV_ID", help="registered env ids; the first is the default")
    add_bind_args(p, default_port=8810)
    p.add_argument("--workers", type=int, default=1, help="worker processes behind the port (SO_REUSEPORT)")
    p.add_argument("--max-worker-rss-mb", type=float, default=0.0, help="recycle a worker past this RSS (0: never)")
    p.add_argument("--max-sessions", type=int, default=512, help="open sessions per worker before 503")
    p.add_argument("--max-concurrency", type=int, default=32, help="env calls running at once per worker")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger bodies/messages are refused (413)")
    p.add_argument("--idle-timeout-s", type=float, default=300.0, help="close sessions silent this long")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from agentrl.envs import UnknownEnvError, make_env
    from agentrl.envserve.server import EnvServerLimits
    from agentrl.envserve.workers import PoolConfig, WorkerPool
    from agentrl.tools.serve import check_port, is_loopback

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
    for env_id in args.env_ids:  # a typo is one line now, not a worker crash loop
        try:
            make_env(env_id).close()
        except UnknownEnvError as err:
            raise UsageError(str(err)) from None
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
