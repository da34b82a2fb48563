"""A real uvicorn tool server on a loopback port: every built-in through the client, local == remote, limits,
sessions, the sandbox under the server, access logs. Auth and the CLI are in test_tools_auth.py."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time
from typing import Annotated

import httpx
import pytest
from pydantic import Field

from agentrl.config.schema import ToolsConfig
from agentrl.tools import Session, ToolClient, build_toolbox, tool
from agentrl.tools.calculator import calculator
from agentrl.tools.pyexec import make_python_tool
from agentrl.tools.search import search
from agentrl.tools.serve import ServerThread
from agentrl.tools.server import ServerLimits, access_log, create_app
from agentrl.tools.sokoban_hint import sokoban_hint

pytestmark = pytest.mark.asyncio(loop_scope="session")  # async fixtures live in the session loop (pyproject)
TOKEN = "test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
python = make_python_tool(timeout_s=4.0, memory_mb=256, max_output_bytes=2000)  # room for a loaded machine


@tool
async def sleepy(seconds: Annotated[float, Field(ge=0, le=5)]) -> str:
    """Sleep (async), for concurrency and timeout tests."""
    await asyncio.sleep(seconds)
    return "slept"


@tool(timeout_s=0.3)
async def too_slow() -> str:
    """Always exceeds its 0.3 s timeout."""
    await asyncio.sleep(5)
    return "never"


@tool
def tally(step: int, session: Session) -> int:
    """Per-episode running total."""
    session.state["n"] = session.state.get("n", 0) + step
    return session.state["n"]


BUILTINS = [calculator, python, search, sokoban_hint]


@pytest.fixture(scope="module")
def server():
    app = create_app([*BUILTINS, sleepy, too_slow, tally], token=TOKEN, limits=ServerLimits(max_sessions=50))
    with ServerThread(app) as url:
        yield url, app


@pytest.fixture
async def client(server):
    async with ToolClient(server[0], token=TOKEN, timeout_s=10) as c:
        yield c


async def test_health_and_listing(client):
    health = await client.health()
    assert health["status"] == "ok" and health["tools"] == 7
    names = [s["function"]["name"] for s in await client.list_tools()]
    assert names == ["calculator", "python", "search", "sokoban_hint", "sleepy", "too_slow", "tally"]


async def test_every_builtin_through_the_client(client):
    r = await client.call("calculator", {"expression": "(3 + 4) * 6"})
    assert r.ok and r.content == "42"
    r = await client.call("python", {"code": "print(sum(range(10)))"})
    assert r.ok and r.content == "45"
    r = await client.call("search", {"query": "capital of France", "k": 1})
    assert r.ok and r.content.startswith("[1] France:") and "Paris" in r.content
    pytest.importorskip("agentrl.envs.sokoban")
    r = await client.call("sokoban_hint", {"grid": "#######\n#P_X_O#\n#######"})
    assert r.ok and r.content.startswith("Right")


async def test_local_and_remote_tools_look_the_same(server):
    url, _ = server
    names = ["calculator", "search", "sokoban_hint"]
    local_cfg = {
        n: {"python": f"agentrl.tools.{m}:{n}"}
        for n, m in zip(names, ["calculator", "search", "sokoban_hint"], strict=True)
    }
    remote_cfg = {n: {"url": url, "token_env": "AGENTRL_TEST_TOOLS_TOKEN"} for n in names}
    cfg = ToolsConfig.model_validate({"sets": {"local": local_cfg, "remote": remote_cfg}})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AGENTRL_TEST_TOOLS_TOKEN", TOKEN)
        local, remote = (
            await asyncio.to_thread(build_toolbox, cfg, ["local"]),
            await asyncio.to_thread(build_toolbox, cfg, ["remote"]),
        )
    assert local.schemas() == remote.schemas()
    assert list(remote.remote) == names and not remote.local
    calls = [
        ("calculator", {"expression": "2**10"}),
        ("calculator", {"expression": "1/0"}),
        ("calculator", {"expr": "1"}),
        ("search", {"query": "speed of light", "k": 1}),
        ("nope", {}),
    ]
    for name, args in calls:
        a, b = await local.call(name, args, "ep"), await remote.call(name, args, "ep")
        assert (a.ok, a.content) == (b.ok, b.content) or name == "nope", (name, a, b)
        assert a.ok == b.ok
    r = await remote.call("calculator", {"expr": "1"}, "ep")
    assert "expression" in r.error and "expr" in r.error  # the bad field is named, as for local tools
    await local.aclose()
    await remote.aclose()


async def test_validation_errors_are_422_naming_the_field(server):
    url, _ = server
    async with httpx.AsyncClient(base_url=url, headers=AUTH) as http:
        r = await http.post("/tools/calculator/call", json={"arguments": {"expression": 5}})
        assert r.status_code == 422
        assert r.json()["detail"][0]["loc"] == ["body", "arguments", "expression"]
        r = await http.post("/tools/calculator/call", json={"arguments": {}})
        assert r.status_code == 422 and "expression" in r.text
        r = await http.post(
            "/tools/calculator/call", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert r.status_code == 422
        r = await http.post("/tools/nope/call", json={"arguments": {}})
        assert r.status_code == 404 and "available tools" in r.json()["detail"]


async def test_body_size_limit(server):
    url, _ = server
    async with httpx.AsyncClient(base_url=url, headers=AUTH) as http:
        big = {"arguments": {"expression": "1" * (2 << 20)}}
        r = await http.post("/tools/calculator/call", json=big)
        assert r.status_code == 413 and "bytes" in r.json()["detail"]

        async def chunks():  # no Content-Length: the streamed body is counted as it arrives
            for _ in range(40):
                yield b" " * 65536

        r = await http.post("/tools/calculator/call", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert (await http.get("/health")).status_code == 200


async def test_per_call_timeout(client):
    r = await client.call("too_slow", {})
    assert not r.ok and "timed out after 0.3s" in r.error and r.seconds < 2


async def test_sessions_isolated_and_closed(server, client):
    assert (await client.call("tally", {"step": 2}, "train/tag/0/a")).content == "2"
    assert (await client.call("tally", {"step": 5}, "train/tag/0/a")).content == "7"
    assert (await client.call("tally", {"step": 1}, "train/tag/0/b")).content == "1"
    await client.close_session("train/tag/0/a")
    assert (await client.call("tally", {"step": 1}, "train/tag/0/a")).content == "1"
    await client.open_session("val/tag/1/c")
    assert "val/tag/1/c" in server[1].state.sessions
    await client.close_session("val/tag/1/c")
    assert "val/tag/1/c" not in server[1].state.sessions
    for sid in ("train/tag/0/a", "train/tag/0/b"):
        await client.close_session(sid)


async def test_too_many_sessions_is_429(server):
    url, app = server
    async with httpx.AsyncClient(base_url=url, headers=AUTH) as http:
        opened = []
        for i in range(60):
            r = await http.post("/sessions/open", json={"session_id": f"train/s/{i}"})
            if r.status_code != 200:
                break
            opened.append(i)
        assert r.status_code == 429 and "too many open sessions" in r.json()["detail"]
        assert len(app.state.sessions) == 50 and opened  # the cap counts every open session
        r = await http.post("/tools/tally/call", json={"arguments": {"step": 1}, "session_id": "one-more"})
        assert r.status_code == 429
        for i in opened:
            await http.post("/sessions/close", json={"session_id": f"train/s/{i}"})
        assert len(app.state.sessions) == 0


async def test_sandbox_limits_under_the_server_and_it_keeps_serving(client):
    loop = asyncio.create_task(client.call("python", {"code": "while True:\n    pass"}))
    bomb = asyncio.create_task(client.call("python", {"code": "a = []\nwhile True:\n    a.append(bytearray(1 << 24))"}))
    flood = asyncio.create_task(client.call("python", {"code": "while True:\n    print('z' * 4096)"}))
    await asyncio.sleep(0.3)
    start = time.perf_counter()  # while three sandboxes misbehave, other calls are answered at once
    r = await client.call("calculator", {"expression": "6*7"})
    assert r.content == "42" and time.perf_counter() - start < 3.0
    assert not loop.done()  # answered while the runaway sandbox was still being stopped
    loop_r, bomb_r, flood_r = await asyncio.gather(loop, bomb, flood)
    assert "wall-time limit" in loop_r.content
    assert "MemoryError" in bomb_r.content
    assert "output truncated at 2000 bytes" in flood_r.content
    assert (await client.health())["status"] == "ok"
    assert (await client.call("python", {"code": "print('still here')"})).content == "still here"


async def test_concurrency_limit_gives_clear_503():
    app = create_app([sleepy], limits=ServerLimits(max_concurrency=1, max_queue=1, queue_timeout_s=0.2))
    with ServerThread(app) as url:
        async with httpx.AsyncClient(base_url=url) as http:

            async def call(sec: float) -> httpx.Response:
                return await http.post("/tools/sleepy/call", json={"arguments": {"seconds": sec}})

            # one runs, one waits in the queue and gives up after 0.2 s, the third finds the queue full
            first = asyncio.create_task(call(1.0))
            await asyncio.sleep(0.1)
            second = asyncio.create_task(call(0.0))
            await asyncio.sleep(0.05)
            third = await call(0.0)
            assert third.status_code == 503 and third.headers["retry-after"] == "1"
            assert "server busy" in third.json()["detail"]
            assert (await second).status_code == 503
            assert (await first).status_code == 200
            assert (await call(0.0)).json()["content"] == "slept"


async def test_client_reports_unreachable_server():
    async with ToolClient("http://127.0.0.1:9", retries=1, backoff_s=0.001, timeout_s=2) as c:
        r = await c.call("calculator", {"expression": "1"})
    assert not r.ok and "unreachable" in r.error and r.content.startswith("Error: ")


async def test_access_log_is_json(server, client):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    old_level = access_log.level
    access_log.addHandler(handler)
    access_log.setLevel(logging.INFO)
    try:
        await client.call("calculator", {"expression": "1+1"})
        async with httpx.AsyncClient(base_url=server[0]) as http:
            await http.get("/tools")  # no token: 401, logged too
        await asyncio.sleep(0.05)
    finally:
        access_log.removeHandler(handler)
        access_log.setLevel(old_level)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    call = next(e for e in lines if e["path"] == "/tools/calculator/call")
    assert call["method"] == "POST" and call["status"] == 200 and call["client"] == "127.0.0.1" and call["ms"] >= 0
    assert any(e["path"] == "/tools" and e["status"] == 401 for e in lines)
    assert TOKEN not in stream.getvalue()
