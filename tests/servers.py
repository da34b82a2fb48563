"""Helpers for tests that start real servers: a free loopback port, waiting for /health, waiting for a condition."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(proc: subprocess.Popen, base: str, timeout_s: float = 60.0) -> None:
    """Poll GET /health until it answers 200; fail at once if the server exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
        time.sleep(0.2)


async def until(condition, what: str, timeout_s: float = 10.0) -> None:
    """Wait for `condition()` (a loaded machine may take long), not for a fixed time; fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)
