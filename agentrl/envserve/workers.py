"""N `serve-envs` worker processes behind one port, each retired and replaced past an RSS limit.

Why processes: env code is Python and often CPU-bound; one event loop (and one GIL) per worker keeps a slow env
from stalling every session. Each worker binds the same host:port with SO_REUSEPORT, so the kernel spreads new
connections over them; a WebSocket session stays on the worker that accepted it.

Why recycling: env memory tends to grow over millions of episodes (caches, leaks in user envs). The supervisor
polls each worker's RSS; past `max_worker_rss_mb` it starts a replacement, waits until it listens, then sends
the old one SIGUSR1: that worker refuses new sessions, ends its open ones with a WORKER_RETIRED error frame
(clients open a new session; the adapter's pool does so on the next reset), and exits.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from agentrl.envserve.server import EnvServerLimits


@dataclass
class PoolConfig:
    env_ids: list[str]
    env_kwargs: dict[str, dict] = field(default_factory=dict)  # constructor kwargs per served env id
    host: str = "127.0.0.1"
    port: int = 8810
    token: str | None = None
    workers: int = 1
    max_worker_rss_mb: float = 0.0  # 0: no recycling
    check_interval_s: float = 2.0
    limits: EnvServerLimits = field(default_factory=EnvServerLimits)
    imports: list[str] = field(default_factory=list)


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def _listen_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host.strip("[]"), port))
    return sock


def worker_main(cfg: PoolConfig, ready: Any) -> None:
    """One worker: the app on a SO_REUSEPORT socket; SIGUSR1 retires it (sessions get WORKER_RETIRED)."""
    import asyncio

    import uvicorn

    from agentrl.envserve.server import create_app
    from agentrl.plugins import import_user_modules

    if cfg.imports:
        import_user_modules(cfg.imports)
    app = create_app(cfg.env_ids, token=cfg.token, limits=cfg.limits, env_kwargs=cfg.env_kwargs)
    sock = _listen_socket(cfg.host, cfg.port)
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        ws_max_size=2 * cfg.limits.max_body_bytes,  # up to this the app answers MESSAGE_TOO_LARGE; beyond, 1009
        timeout_graceful_shutdown=5,
        backlog=4096,
    )
    server = uvicorn.Server(config)

    async def retire() -> None:
        await app.state.service.retire(f"worker RSS over {cfg.max_worker_rss_mb:g} MiB (pid {os.getpid()})")
        server.should_exit = True

    async def main() -> None:
        loop = asyncio.get_running_loop()
        serve = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not serve.done():
            await asyncio.sleep(0.01)
        loop.add_signal_handler(signal.SIGUSR1, lambda: asyncio.ensure_future(retire()))
        ready.set()
        await serve

    asyncio.run(main())


class WorkerPool:
    """Starts, watches and recycles the workers; `run()` blocks until SIGINT/SIGTERM."""

    def __init__(self, cfg: PoolConfig) -> None:
        self.cfg = cfg
        self.ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.stopping = False
        self.recycled = 0

    def _start_one(self, timeout_s: float = 120.0) -> Any:
        ready = self.ctx.Event()
        proc = self.ctx.Process(target=worker_main, args=(self.cfg, ready), daemon=True)
        proc.start()
        deadline = time.monotonic() + timeout_s
        while not ready.wait(0.1):
            if not proc.is_alive() or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"env server worker failed to start (exit code {proc.exitcode})")
        return proc

    def start(self) -> None:
        _listen_socket(self.cfg.host, self.cfg.port).close()  # a taken port fails here, once
        self.procs = [self._start_one() for _ in range(self.cfg.workers)]

    def check(self) -> None:
        """Replace dead workers; retire the ones over the RSS limit (replacement first). A replacement that
        fails to start is logged and tried again at the next check; the pool keeps serving meanwhile."""
        try:
            self._check()
        except RuntimeError as err:
            _log("worker_start_failed", error=str(err))

    def _check(self) -> None:
        for i, proc in enumerate(self.procs):
            if not proc.is_alive():
                _log("worker_exited", pid=proc.pid, exitcode=proc.exitcode)
                self.procs[i] = self._start_one()
            elif self.cfg.max_worker_rss_mb and _rss_mb(proc.pid) > self.cfg.max_worker_rss_mb:
                rss = _rss_mb(proc.pid)
                self.procs[i] = self._start_one()
                _log("worker_recycled", pid=proc.pid, rss_mb=round(rss, 1), replacement=self.procs[i].pid)
                self.recycled += 1
                os.kill(proc.pid, signal.SIGUSR1)
                proc.join(timeout=15)
                if proc.is_alive():
                    proc.kill()

    def stop(self) -> None:
        self.stopping = True
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()

    def run(self) -> None:
        self.start()
        cfg = self.cfg
        _log("serving", host=cfg.host, port=cfg.port, envs=cfg.env_ids, workers=[p.pid for p in self.procs])
        signal.signal(signal.SIGTERM, _interrupt)
        try:
            while True:
                time.sleep(cfg.check_interval_s)
                self.check()
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


def _log(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), file=sys.stderr, flush=True)
