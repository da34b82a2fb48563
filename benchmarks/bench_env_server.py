"""Load on `agentrl serve-envs`: N concurrent OpenEnv sessions for T seconds, as JSON.

    python benchmarks/bench_env_server.py [--sessions 256] [--seconds 60] [--workers 2] [--env agentrl/SimpleSokoban-v0]

Starts `agentrl serve-envs` as a subprocess (its defaults otherwise: loopback, no token), then runs N closed-loop
clients on one asyncio loop, each holding one WebSocket session: reset(seed), then steps (a random move, an
unparsable answer every fifth turn) until the episode ends, then the next seed. Reports steps/s and resets/s,
p50/p99 latency per call kind, errors by kind (handshake HTTP status, error-frame code, client exception), the
server's health after the run (it must still answer) and each worker's RSS at the end. The load generator shares
the machine's cores with the server: absolute numbers are a floor.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

MOVES = ["Up", "Down", "Left", "Right"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children_rss_mb(pid: int) -> dict[int, float]:
    """RSS of each direct child of `pid` (the workers; multiprocessing's resource tracker left out), from /proc."""
    out = {}
    page = os.sysconf("SC_PAGE_SIZE")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid and b"resource_tracker" not in (entry / "cmdline").read_bytes():
                out[int(entry.name)] = round(int((entry / "statm").read_text().split()[1]) * page / 2**20, 1)
        except (OSError, ValueError, IndexError):
            continue
    return out


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(1000 * values[min(len(values) - 1, int(q * len(values)))], 3)


async def client(i: int, ws_url: str, stop_at: float, lat: dict[str, list[float]], errors: Counter) -> None:
    rng = random.Random(i)
    seed = i * 100_000
    while time.monotonic() < stop_at:
        try:
            async with connect(ws_url, open_timeout=30, max_size=1 << 22) as ws:
                while time.monotonic() < stop_at:
                    done, turn = await call(ws, "reset", {"seed": seed}, lat, errors), 0
                    seed += 1
                    while not done and time.monotonic() < stop_at:
                        text = "hmm" if turn % 5 == 4 else f"<answer>{rng.choice(MOVES)}</answer>"
                        done = await call(ws, "step", {"message": text}, lat, errors)
                        turn += 1
        except InvalidStatus as err:
            errors[f"http_{err.response.status_code}"] += 1
            await asyncio.sleep(0.2)
        except Exception as err:
            errors[f"client_{type(err).__name__}"] += 1
            await asyncio.sleep(0.2)


async def call(ws, kind: str, data: dict, lat: dict[str, list[float]], errors: Counter) -> bool:
    t0 = time.perf_counter()
    await ws.send(json.dumps({"type": kind, "data": data}))
    reply = json.loads(await ws.recv())
    lat[kind].append(time.perf_counter() - t0)
    if reply.get("type") == "error":
        errors[f"frame_{reply['data'].get('code')}"] += 1
        return True
    return bool(reply["data"].get("done"))


async def drive(ws_url: str, sessions: int, seconds: float) -> tuple[dict, Counter, float]:
    lat: dict[str, list[float]] = {"reset": [], "step": []}
    errors: Counter = Counter()
    t0 = time.monotonic()
    stop_at = t0 + seconds
    await asyncio.gather(*(client(i, ws_url, stop_at, lat, errors) for i in range(sessions)))
    return lat, errors, time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--env", default="agentrl/SimpleSokoban-v0")
    args = ap.parse_args()
    port = free_port()
    cmd = [sys.executable, "-m", "agentrl", "serve-envs", args.env, "--port", str(port)]
    cmd += ["--workers", str(args.workers), "--max-sessions", str(max(512, args.sessions))]
    server = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("serve-envs did not start")
            time.sleep(0.2)
        rss_start = children_rss_mb(server.pid)
        lat, errors, wall = asyncio.run(drive(f"ws://127.0.0.1:{port}/ws", args.sessions, args.seconds))
        health = httpx.get(f"{base}/health", timeout=10)
        report = {
            "env": args.env,
            "sessions": args.sessions,
            "seconds": round(wall, 2),
            "workers": args.workers,
            "steps_per_s": round(len(lat["step"]) / wall, 1),
            "resets_per_s": round(len(lat["reset"]) / wall, 1),
            "steps": len(lat["step"]),
            "resets": len(lat["reset"]),
            "latency_ms": {k: {"p50": pct(v, 0.5), "p99": pct(v, 0.99)} for k, v in lat.items()},
            "mean_step_ms": round(1000 * statistics.fmean(lat["step"]), 3) if lat["step"] else None,
            "errors": dict(errors),
            "server_alive": server.poll() is None,
            "health_after": health.status_code,
            "worker_rss_mb_start": rss_start,
            "worker_rss_mb_end": children_rss_mb(server.pid),
            "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(),
        }
        print(json.dumps(report, indent=2))
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
