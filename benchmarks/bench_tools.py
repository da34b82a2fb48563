"""Tool-server overhead: calls/s and p50/p99 latency of the tool server vs a bare FastAPI endpoint, and of
agentrl's own `ToolClient` against the tool server, as JSON.

    python benchmarks/bench_tools.py [--seconds 3] [--concurrency 64] [--rounds 5] [--workloads echo calculator]

Both servers run as separate uvicorn processes (same settings: uvloop/httptools when installed, one worker),
started by this script. The tool server is the real `create_app` with everything on: bearer auth, the body
limit, the concurrency limiter, sessions, per-call timeout and JSON access logs (written to /dev/null). The
bare server is one FastAPI route per workload with a pydantic body doing the same work: `echo` returns a string,
`calculator` evaluates the expression with the same `evaluate`, inline in an `async def` route (the tool is
async too: both run it on the event loop, with no worker-thread hop). The tool server answers valid calls on
its own fast path (validated in one pydantic-core pass, past Starlette's routing and FastAPI's request parsing;
see agentrl.tools.server), so it can beat the bare route, which is plain FastAPI as a user would write it.

Each round runs, back to back and at the same fixed concurrency, the bare server, the tool server and the tool
server through `ToolClient`; the order rotates between rounds. The ratios are computed per round and the median
of the per-round ratios is reported, so a machine whose load drifts (other jobs on shared cores) moves both
sides of a ratio together. Load for the two servers comes from a minimal keep-alive HTTP/1.1 client on raw
asyncio sockets (one connection per simulated client, closed loop), so it measures the server, not a client;
`via_toolclient` is what an env manager sees end to end (`ToolClient` on its aiohttp keep-alive pool;
`--alt-client` measures another copy of tools/client.py in the same rounds). The load
generator shares the machine's cores with the server, so absolute numbers are a floor. Closed loop means mean
latency >= clients / throughput (Little's law), whatever the server does per call: p99 at 64 clients can only be
<= 10 ms above ~6.4k calls/s.

CPU per call: `server_cpu_us_per_call` is the server process's own CPU time (from /proc) over the calls it
answered in that run, `client_cpu_us_per_call` the load generator's (this process); both are far less
disturbed by a busy machine than calls/s. `in_process_asgi_cpu_per_call` calls both apps directly as ASGI (no
sockets): the framework-plus-tool cost alone. The machine's load average before and after is recorded.
"""

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

TOKEN = "bench-token-0123456789"
WORKLOADS = {  # name: (tool path, tool body, bare path, bare body)
    "echo": ("/tools/echo/call", b'{"arguments": {"text": "hi"}}', "/echo", b'{"text": "hi"}'),
    "calculator": (
        "/tools/calculator/call",
        b'{"arguments": {"expression": "(3 + 4) * 12 / 5"}}',
        "/calc",
        b'{"expression": "(3 + 4) * 12 / 5"}',
    ),
}
CLIENT_ARGS = {"echo": {"text": "hi"}, "calculator": {"expression": "(3 + 4) * 12 / 5"}}


# ---------------------------------------------------------------- servers (run in child processes)


def _bare_app() -> Any:  # no `from __future__ import annotations` here: FastAPI reads the models at runtime
    from fastapi import FastAPI
    from pydantic import BaseModel

    from agentrl.tools.calculator import evaluate

    class Echo(BaseModel):
        text: str

    class Calc(BaseModel):
        expression: str

    app = FastAPI()

    @app.post("/echo")
    async def echo(body: Echo) -> dict:
        return {"content": body.text, "ok": True}

    @app.post("/calc")
    async def calc(body: Calc) -> dict:
        try:
            return {"content": str(evaluate(body.expression)), "ok": True}
        except ValueError as err:
            return {"content": f"Error: {err}", "ok": False}

    return app


def _tool_app() -> Any:
    from agentrl.tools import tool
    from agentrl.tools.calculator import calculator
    from agentrl.tools.serve import enable_access_log
    from agentrl.tools.server import create_app

    @tool
    async def echo(text: str) -> str:
        """Return the text."""
        return text

    enable_access_log(open(os.devnull, "w"))  # noqa: SIM115 - lives as long as the server process
    return create_app([echo, calculator], token=TOKEN)


def serve(kind: str, port: int) -> None:
    import uvicorn

    app = _tool_app() if kind == "tool" else _bare_app()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# ---------------------------------------------------------------- load generators


def _request(kind: str, workload: str, port: int) -> bytes:
    tool_path, tool_body, bare_path, bare_body = WORKLOADS[workload]
    if kind == "tool":
        path, body, extra = tool_path, tool_body, f"Authorization: Bearer {TOKEN}\r\n"
    else:
        path, body, extra = bare_path, bare_body, ""
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
            body = await reader.readexactly(length)
            t1 = time.perf_counter()
            if not head.startswith(b"HTTP/1.1 200") or b'"ok":true' not in body.replace(b" ", b""):
                errors.append(1)
            elif t0 >= start_at:  # warm-up requests are not counted
                lat.append(t1 - t0)
    finally:
        writer.close()


async def _raw_load(port: int, kind: str, workload: str, concurrency: int, seconds: float, warmup: float) -> tuple:
    req = _request(kind, workload, port)
    lat: list[float] = []
    errors: list[int] = []
    now = time.perf_counter()
    start_at, stop_at = now + warmup, now + warmup + seconds
    await asyncio.gather(*(_client(port, req, start_at, stop_at, lat, errors) for _ in range(concurrency)))
    return lat, len(errors)


def _load_toolclient(path: str | None) -> Any:
    """`ToolClient` of agentrl, or of another copy of tools/client.py (`--alt-client`, e.g. a previous version)."""
    if path is None:
        from agentrl.tools import ToolClient

        return ToolClient
    import importlib.util

    spec = importlib.util.spec_from_file_location("alt_tool_client", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ToolClient


async def _toolclient_load(
    port: int, workload: str, concurrency: int, seconds: float, warmup: float, client_path: str | None = None
) -> tuple:
    ToolClient = _load_toolclient(client_path)

    lat: list[float] = []
    errors = [0]
    args = CLIENT_ARGS[workload]
    async with ToolClient(f"http://127.0.0.1:{port}", token=TOKEN) as client:
        now = time.perf_counter()
        start_at, stop_at = now + warmup, now + warmup + seconds

        async def worker() -> None:
            while True:
                t0 = time.perf_counter()
                if t0 >= stop_at:
                    return
                r = await client.call(workload, args)
                t1 = time.perf_counter()
                if not r.ok:
                    errors[0] += 1
                elif t0 >= start_at:
                    lat.append(t1 - t0)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return lat, errors[0]


def _pct(lat: list[float], q: float) -> float | None:
    if not lat:
        return None
    s = sorted(lat)
    return round(s[min(len(s) - 1, int(len(s) * q))] * 1000, 2)


def _proc_cpu_s(pid: int) -> float | None:
    """utime + stime of a process, in seconds (Linux /proc); None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _run_once(
    label: str, server: tuple, workload: str, concurrency: int, seconds: float, warmup: float, alt: str | None = None
) -> dict:
    """One timed run on a fresh event loop: calls/s, p50/p99, errors, server and client CPU per call."""
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    proc, port = server
    if label.startswith("via_toolclient"):
        path = alt if label == "via_toolclient_alt" else None
        coro = _toolclient_load(port, workload, concurrency, seconds, warmup, path)
    else:
        coro = _raw_load(port, "tool" if label == "tool_server" else "bare", workload, concurrency, seconds, warmup)
    srv0, cli0 = _proc_cpu_s(proc.pid), time.process_time()
    try:
        lat, errors = loop.run_until_complete(coro)
    finally:
        loop.close()
    srv1, cli1 = _proc_cpu_s(proc.pid), time.process_time()
    n = len(lat)
    total = n * (seconds + warmup) / seconds  # calls answered in the whole run, warm-up included (approx.)
    return {
        "calls_per_s": round(n / seconds, 1),
        "p50_ms": _pct(lat, 0.50),
        "p99_ms": _pct(lat, 0.99),
        "calls": n,
        "errors": errors,
        "server_cpu_us_per_call": round((srv1 - srv0) / total * 1e6, 1) if srv0 is not None and n else None,
        "client_cpu_us_per_call": round((cli1 - cli0) / total * 1e6, 1) if n else None,
        "_lat": lat,
    }


# ---------------------------------------------------------------- in-process (no sockets)


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

    t0 = time.process_time()
    for _ in range(n):
        await app(dict(scope), receive, send)
    return (time.process_time() - t0) / n * 1e6


async def _asgi_compare(batches: int = 10) -> dict:
    bare, tool_app = _bare_app(), _tool_app()
    auth = [(b"authorization", f"Bearer {TOKEN}".encode())]
    tool_path, tool_body, bare_path, bare_body = WORKLOADS["echo"]
    xs, ys = [], []
    for _ in range(batches):  # interleaved; the minimum is the least disturbed by other processes
        xs.append(await _asgi_us_per_call(bare, bare_path, bare_body, []))
        ys.append(await _asgi_us_per_call(tool_app, tool_path, tool_body, auth))
    return {
        "workload": "echo",
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


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 3)


def _summary(runs: list[dict]) -> dict:
    """Per-round numbers plus medians over rounds and p50/p99 over all rounds' calls together."""
    lat = [x for r in runs for x in r["_lat"]]

    def med(key: str) -> float | None:
        xs = [r[key] for r in runs if r[key] is not None]
        return round(statistics.median(xs), 1) if xs else None

    return {
        "calls_per_s_median": med("calls_per_s"),
        "p50_ms": _pct(lat, 0.50),
        "p99_ms": _pct(lat, 0.99),
        "p99_ms_median_of_rounds": med("p99_ms"),
        "errors": sum(r["errors"] for r in runs),
        "server_cpu_us_per_call_median": med("server_cpu_us_per_call"),
        "client_cpu_us_per_call_median": med("client_cpu_us_per_call"),
        "rounds_calls_per_s": [r["calls_per_s"] for r in runs],
        "rounds_p99_ms": [r["p99_ms"] for r in runs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="timed seconds per run (after 0.5 s warm-up)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64], help="closed-loop clients (fixed per run)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians of per-round ratios")
    ap.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    ap.add_argument("--alt-client", help="also measure ToolClient from this copy of tools/client.py (same rounds)")
    ap.add_argument("--serve", choices=["tool", "bare"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.port)
        return
    load_before = [round(x, 2) for x in os.getloadavg()]
    started = time.time()
    asgi = asyncio.run(_asgi_compare())
    servers = {"bare": _start("bare"), "tool": _start("tool")}
    which = {"bare_fastapi": servers["bare"], "tool_server": servers["tool"], "via_toolclient": servers["tool"]}
    if args.alt_client:
        which["via_toolclient_alt"] = servers["tool"]
    labels = list(which)
    results: dict[str, Any] = {}
    try:
        for c in args.concurrency:
            for w in args.workloads:
                runs: dict[str, list[dict]] = {k: [] for k in labels}
                for r in range(args.rounds):
                    k = r % len(labels)
                    for label in labels[k:] + labels[:k]:  # rotate the order between rounds
                        runs[label].append(_run_once(label, which[label], w, c, args.seconds, 0.5, args.alt_client))
                tool_ratio = [
                    t["calls_per_s"] / max(b["calls_per_s"], 1e-9)
                    for t, b in zip(runs["tool_server"], runs["bare_fastapi"], strict=True)
                ]
                client_ratio = [
                    v["calls_per_s"] / max(t["calls_per_s"], 1e-9)
                    for v, t in zip(runs["via_toolclient"], runs["tool_server"], strict=True)
                ]
                summary = {label: _summary(runs[label]) for label in labels}
                if args.alt_client:
                    alt_ratio = [
                        a["calls_per_s"] / max(t["calls_per_s"], 1e-9)
                        for a, t in zip(runs["via_toolclient_alt"], runs["tool_server"], strict=True)
                    ]
                    summary["alt_toolclient_over_tool_throughput_median"] = _median(alt_ratio)  # type: ignore[assignment]
                    summary["alt_toolclient_over_tool_rounds"] = [round(x, 3) for x in alt_ratio]  # type: ignore[assignment]
                tool_p99 = summary["tool_server"]["p99_ms"]
                results.setdefault(str(c), {})[w] = {
                    **summary,
                    "tool_over_bare_throughput_median": _median(tool_ratio),
                    "tool_over_bare_rounds": [round(x, 3) for x in tool_ratio],
                    "toolclient_over_tool_throughput_median": _median(client_ratio),
                    "toolclient_over_tool_rounds": [round(x, 3) for x in client_ratio],
                    "meets_tool_over_bare_0.8": _median(tool_ratio) >= 0.8,
                    "meets_toolclient_within_10pct": _median(client_ratio) >= 0.9,
                    "meets_p99_10ms": tool_p99 is not None and tool_p99 <= 10.0,
                    # closed loop: mean latency >= clients / throughput, whatever the server does per call
                    "littles_law_mean_ms_tool": round(
                        1000 * c / max(summary["tool_server"]["calls_per_s_median"] or 0, 1e-9), 2
                    ),
                }
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=10)
    print(
        json.dumps(
            {
                "benchmark": "tool_server_vs_bare_fastapi",
                "seconds_per_run": args.seconds,
                "rounds": args.rounds,
                "wall_s": round(time.time() - started, 1),
                "by_concurrency": results,
                "in_process_asgi_cpu_per_call": asgi,
                "machine": {
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "loadavg_1_5_15_before": load_before,
                    "loadavg_1_5_15_after": [round(x, 2) for x in os.getloadavg()],
                },
                "targets": {"tool_over_bare": 0.8, "toolclient_over_tool": 0.9, "p99_ms_at_64": 10.0},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
