"""`agentrl view RUN_DIR [--port N] [--host H --token-env VAR]`: the run's curves, config and logged episodes in the
browser, live while the run trains (`agentrl.viewer`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from agentrl.cli import UsageError
from agentrl.cli.server_args import add_bind_args, bearer_token


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("view", parents=[common], help="a run's curves, config and episodes in the browser")
    p.add_argument("run_dir", help="a run dir (logging.run_dir), finished or still training")
    add_bind_args(p, default_port=8820)
    p.set_defaults(func=_view)


def _view(args: argparse.Namespace) -> int:
    from agentrl.addresses import is_loopback
    from agentrl.tools.serve import ServeError, check_port
    from agentrl.viewer.server import serve

    run_dir = Path(args.run_dir)
    if not (run_dir / "metrics.jsonl").is_file() and not (run_dir / "config.yaml").is_file():
        raise UsageError(f"{run_dir} is not a run dir (no metrics.jsonl or config.yaml in it)")
    token = bearer_token(args)
    if token is None and not is_loopback(args.host):
        raise UsageError(
            f"refusing to serve the viewer on {args.host} without auth (episodes, config): pass --token-env VAR "
            "(bearer token in $VAR) or bind to 127.0.0.1"
        )
    try:
        check_port(args.host, args.port)
    except ServeError as err:
        raise UsageError(str(err)) from None
    suffix = "/?token=..." if token else "/"
    print(f"agentrl: viewing {run_dir} at http://{args.host}:{args.port}{suffix} (Ctrl-C stops)", flush=True)
    serve(run_dir, args.host, args.port, token)
    return 0
