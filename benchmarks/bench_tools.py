"""Tool-server overhead: calls/s and p50/p99 latency of a trivial tool vs a bare FastAPI endpoint, as JSON.

    python benchmarks/bench_tools.py [--seconds 3] [--concurrency 64 256] [--rounds 2]

Both servers run as separate uvicorn processes (same settings: uvloop/httptools when installed, one worker),
started by this script. The tool server is the real `create_app` with everything on: bearer auth, the body
limit, the concurrency limiter, sessions, per-call timeout and JSON access logs (written to /dev/null). The
bare server is one FastAPI route with a pydantic body doing the same work (echo a string).

Load comes from a minimal keep-alive HTTP/1.1 client on raw asyncio sockets (one connection per simulated
client, closed loop): httpx costs ~10x more CPU per request than uvicorn does and would measure itself, not
the server. The load generator shares the machine's cores with the server, so absolute numbers are a floor;
the ratio (tool / bare, same run, interleaved rounds) is the number to read. `via_toolclient` adds the real
`ToolClient` (httpx) at 1 and 64 clients: what an env manager sees end to end. `in_process_asgi_cpu_per_call`
calls both apps directly (no sockets): server CPU per call, the figure least disturbed by a busy machine.
"""

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time
from typing import Any

TOKEN = "bench-token-0123456789"


# ---------------------------------------------------------------- servers (run in child processes)


def _bare_app() -> Any:  # no `from __future__ import annotations` here: FastAPI reads `Echo` at runtime
    from fastapi import FastAPI
    from pydantic import BaseModel

    class Echo(BaseModel):
        text: str

    app = FastAPI()

    @app.post("/echo")
    async def echo(body: Echo) -> dict:
        return {"content": body.text, "ok": True}

    return app


def _tool_app() -> Any:
    from agentrl.tools import tool
    from agentrl.tools.serve import enable_access_log
    from agentrl.tools.server import create_app

    @tool
    async def echo(text: str) -> str:
        """Return the text."""
        return text

    enable_access_log(open(os.devnull, "w"))  # noqa: SIM115 - lives as long as the server process
    return create_app([echo], token=TOKEN)


def serve(kind: str, port: int) -> None:
    import uvicorn

    app = _tool_app() if kind == "tool" else _bare_app()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# ---------------------------------------------------------------- load generator


def _request(kind: str, port: int) -> bytes:
    if kind == "tool":
        path, body, extra = "/tools/echo/call", b'{"arguments": {"text": "hi"}}', f"Authorization: Bearer {TOKEN}\r\n"
    else:
        path, body, extra = "/echo", b'{"text": "hi"}', ""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    )
    return head.encode() + body


async def _client(port: int, req: bytes, start_at: float, stop_at: float, lat: list[float], errors: list[int]):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while True:
            t0 = time.perf_counter()
            if t0 >= stop_at:
                return
            writer.write(req)
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            await reader.readexactly(length)
            t1 = time.perf_counter()
            if not head.startswith(b"HTTP/1.1 200"):
                errors.append(1)
            elif t0 >= start_at:  # warm-up requests are not counted
                lat.append(t1 - t0)
    finally:
        writer.close()


async def _load(port: int, kind: str, concurrency: int, seconds: float, warmup: float = 0.5) -> dict:
    req = _request(kind, port)
    lat: list[float] = []
    errors: list[int] = []
    now = time.perf_counter()
    start_at, stop_at = now + warmup, now + warmup + seconds
    await asyncio.gather(*(_client(port, req, start_at, stop_at, lat, errors) for _ in range(concurrency)))
    return _summary(lat, seconds, len(errors))


def _summary(lat: list[float], seconds: float, errors: int) -> dict:
    lat.sort()
    n = len(lat)
    return {
        "calls_per_s": round(n / seconds, 1),
        "p50_ms": round(lat[n // 2] * 1000, 2) if n else None,
        "p99_ms": round(lat[min(n - 1, int(n * 0.99))] * 1000, 2) if n else None,
        "calls": n,
        "errors": errors,
    }


async def _via_toolclient(port: int, concurrency: int, seconds: float) -> dict:
    from agentrl.tools import ToolClient

    lat: list[float] = []
    errors = [0]
    async with ToolClient(f"http://127.0.0.1:{port}", token=TOKEN) as client:
        stop_at = time.perf_counter() + seconds

        async def worker() -> None:
            while time.perf_counter() < stop_at:
                t0 = time.perf_counter()
                r = await client.call("echo", {"text": "hi"})
                lat.append(time.perf_counter() - t0)
                errors[0] += not r.ok

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return _summary(lat, seconds, errors[0])


async def _asgi_us_per_call(app: Any, path: str, body: bytes, headers: list, n: int = 400) -> float:
    """Server CPU per call with no sockets at all: the app called directly as ASGI (stable on a busy box)."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
    }  # fmt: skip

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start" and message["status"] != 200:
            raise RuntimeError(f"{path}: status {message['status']}")

    t0 = time.perf_counter()
    for _ in range(n):
        await app(dict(scope), receive, send)
    return (time.perf_counter() - t0) / n * 1e6


async def _asgi_compare(batches: int = 10) -> dict:
    bare, tool_app = _bare_app(), _tool_app()
    auth = [(b"authorization", f"Bearer {TOKEN}".encode())]
    xs, ys = [], []
    for _ in range(batches):  # interleaved; the minimum is the least disturbed by other processes
        xs.append(await _asgi_us_per_call(bare, "/echo", b'{"text": "hi"}', []))
        ys.append(await _asgi_us_per_call(tool_app, "/tools/echo/call", b'{"arguments": {"text": "hi"}}', auth))
    return {
        "bare_us": round(min(xs), 1),
        "tool_us": round(min(ys), 1),
        "ratio_bare_over_tool": round(min(xs) / min(ys), 3),
    }


# ---------------------------------------------------------------- orchestration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(kind: str) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", kind, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, port
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"{kind} server exited with {proc.returncode}") from None
            time.sleep(0.1)
    raise RuntimeError(f"{kind} server did not start")


def _median_run(runs: list[dict]) -> dict:
    best = sorted(runs, key=lambda r: r["calls_per_s"])[len(runs) // 2]
    return {**best, "rounds_calls_per_s": [r["calls_per_s"] for r in runs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--rounds", type=int, default=3, help="interleaved bare/tool rounds; the median is reported")
    ap.add_argument("--serve", choices=["tool", "bare"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.port)
        return
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = asyncio.new_event_loop
    asgi = asyncio.run(_asgi_compare())
    servers = {kind: _start(kind) for kind in ("bare", "tool")}
    try:
        results = {}
        for c in args.concurrency:
            runs: dict[str, list[dict]] = {"bare": [], "tool": []}
            for _ in range(args.rounds):
                for kind in ("bare", "tool"):
                    loop = loop_factory()
                    runs[kind].append(loop.run_until_complete(_load(servers[kind][1], kind, c, args.seconds)))
                    loop.close()
            bare, toolr = _median_run(runs["bare"]), _median_run(runs["tool"])
            results[str(c)] = {
                "bare_fastapi": bare,
                "tool_server": toolr,
                "throughput_ratio": round(toolr["calls_per_s"] / bare["calls_per_s"], 3),
                "meets_ratio_target_0.8": toolr["calls_per_s"] >= 0.8 * bare["calls_per_s"],
                "meets_p99_target_10ms": toolr["p99_ms"] is not None and toolr["p99_ms"] <= 10.0,
                # closed loop: mean latency >= clients / throughput, whatever the server does per call
                "littles_law_mean_ms_tool": round(1000 * c / max(toolr["calls_per_s"], 1e-9), 2),
            }
        via = {}
        for c in (1, 64):
            loop = loop_factory()
            via[str(c)] = loop.run_until_complete(_via_toolclient(servers["tool"][1], c, args.seconds))
            loop.close()
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=10)
    print(
        json.dumps(
            {
                "benchmark": "tool_server_vs_bare_fastapi",
                "tool": "echo (async, trivial)",
                "seconds_per_run": args.seconds,
                "rounds": args.rounds,
                "by_concurrency": results,
                "via_toolclient_by_concurrency": via,
                "in_process_asgi_cpu_per_call": asgi,
                "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                "targets": {"throughput_ratio": 0.8, "p99_ms_at_256": 10.0},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
