"""Running a tool server: load TOOLS.yaml, check the bind address against auth, start uvicorn.

TOOLS.yaml is either a `tools:` section on its own (`sets: {set: {name: {python: mod:fn, timeout_s: ...}}}`)
or a whole run config with a `tools:` key; every `python:` tool of every set is served.
`ServerThread` runs the same app on a free loopback port inside the current process (tests, benchmarks).
"""

from __future__ import annotations

import errno
import json
import logging
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn
import yaml
from pydantic import ValidationError

from agentrl.addresses import is_loopback
from agentrl.config.schema import ToolsConfig
from agentrl.tools.core import Tool
from agentrl.tools.server import ServerLimits, access_log, create_app
from agentrl.tools.toolbox import load_python_tool


class ServeError(ValueError):
    """A mistake in what the user asked to serve (bad file, unsafe bind); printed as one line."""


def check_bind(host: str, token: str | None) -> None:
    """Refuse to expose tools (python execution among them) beyond this machine without a token."""
    if token is None and not is_loopback(host):
        raise ServeError(
            f"refusing to serve tools on {host} without auth: anyone who can reach it could run them. "
            "Pass --token-env VAR (bearer token in $VAR) or bind to 127.0.0.1"
        )


def check_port(host: str, port: int) -> None:
    """`host:port` can be bound now: a port in use is one line saying what to do (uvicorn would log its own error
    and exit 1 after the tools load)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as err:
        raise ServeError(
            f"--host {host}: cannot resolve it ({err.strerror}); use an address such as 127.0.0.1"
        ) from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(addr)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise ServeError(
                    f"port {port} on {host} is already in use (another serve-tools?): pass a free one with --port N, "
                    f"or stop the process listening on it (`ss -ltnp 'sport = :{port}'` names it)"
                ) from None
            if err.errno == errno.EACCES:
                raise ServeError(f"cannot bind {host}:{port}: permission denied; use a port above 1023") from None
            raise ServeError(f"cannot bind {host}:{port}: {err.strerror}; pick another --host or --port") from None


def load_tools_file(path: str | Path) -> list[Tool]:
    """TOOLS.yaml -> the python tools it names (url: tools are refused: a server does not proxy)."""
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ServeError(f"{path}: {err}") from None
    if isinstance(raw, dict) and "tools" in raw and "sets" not in raw:
        raw = raw["tools"] or {}
    try:
        cfg = ToolsConfig.model_validate(raw)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise ServeError(f"{path}: tools.{loc}: {first['msg']}") from None
    tools: dict[str, Tool] = {}
    specs: dict[str, Any] = {}
    for set_name, entries in cfg.sets.items():
        for name, spec in entries.items():
            if spec.python is None:
                raise ServeError(f"{path}: tools.sets.{set_name}.{name}: a tool server serves python: tools only")
            if name in specs:
                if specs[name] != spec:
                    raise ServeError(f"{path}: tool {name!r} is defined differently in two sets")
                continue
            try:
                tools[name] = load_python_tool(spec.python, name=name, timeout_s=spec.timeout_s)
            except (ValueError, TypeError) as err:
                raise ServeError(f"{path}: tools.sets.{set_name}.{name}: {err}") from None
            problem = tools[name].check() if tools[name].check else None
            if problem:
                raise ServeError(f"{path}: tools.sets.{set_name}.{name}: {problem}")
            specs[name] = spec
    if not tools:
        raise ServeError(f"{path}: no tools to serve (expected sets: {{set: {{name: {{python: mod:fn}}}}}})")
    return list(tools.values())


def enable_access_log(stream: Any = None) -> None:
    """One JSON object per request and line on stderr (method, path, status, ms, client); the lines of requests
    that finish in the same event-loop turn arrive as one log record (see `GuardMiddleware._flush_log`)."""
    if access_log.handlers:
        return
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access_log.addHandler(handler)
    access_log.setLevel(logging.INFO)
    access_log.propagate = False


def serve(
    tools: list[Tool], host: str, port: int, token: str | None = None, limits: ServerLimits | None = None
) -> None:
    """Run the tool server in the foreground until interrupted."""
    check_bind(host, token)
    enable_access_log()
    app = create_app(tools, token=token, limits=limits)
    print(
        json.dumps({"event": "serving", "host": host, "port": port, "tools": [t.name for t in tools]}),
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False, timeout_graceful_shutdown=5)


class ServerThread:
    """A real uvicorn server on a free loopback port, in a thread: `with ServerThread(app) as url:`."""

    def __init__(self, app: Any, host: str = "127.0.0.1") -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("tool server thread failed to start")
            time.sleep(0.01)
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
