"""The two fast paths behind tool-server throughput: the server's tool-call path (valid calls skip FastAPI's
routing and request parsing; everything else must be answered exactly as the FastAPI route answers it) and the
client's keep-alive pool (aiohttp), against scripted servers: every HTTP/1.1 answer shape,
connections the server closed while idle, timeouts, its connection limit, proxies from the environment and the
retry rules.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

import httpx
import pytest
from pydantic import Field

from agentrl.tools import ToolClient, tool
from agentrl.tools.calculator import calculator
from agentrl.tools.serve import ServerThread
from agentrl.tools.server import ServerLimits, create_app
from tests.servers import until

TOKEN = "fast-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@tool
async def pick(n: Annotated[int, Field(ge=0, le=9)], tags: list[str] | None = None, flag: bool = False) -> str:
    """Echo its arguments."""
    return f"{n}:{tags}:{flag}"


def _apps(**kw) -> tuple[object, object]:
    """The same server twice: with its fast path, and with every call going through the FastAPI route."""
    fast = create_app([calculator, pick], token=TOKEN, **kw)
    slow = create_app([calculator, pick], token=TOKEN, **kw)
    slow.user_middleware[0].kwargs["fast_calls"] = {}
    return fast, slow


BODIES = [
    (b'{"arguments": {"expression": "6*7"}}', "application/json"),
    (b'{"arguments": {"expression": "6*7"}, "session_id": "train/a/0"}', "application/json"),
    (b'{"arguments": {"expression": 5}}', "application/json"),
    (b'{"arguments": {}}', "application/json"),
    (b'{"arguments": {"expression": "1"}, "extra": 1}', "application/json"),
    (b'{"arguments": {"expression": "1"}, "session_id": ""}', "application/json"),
    (b'{"arguments": {"expression": "1"}, "session_id": "' + b"s" * 300 + b'"}', "application/json"),
    (b"{not json", "application/json"),
    (b"", "application/json"),
    (b"[]", "application/json"),
    (b'{"arguments": {"expression": "1/0"}}', "application/json"),
    (b'{"arguments": {"expression": "2+2"}}', "application/json; charset=utf-8"),
    (b'{"arguments": {"expression": "2+2"}}', "APPLICATION/JSON"),
    (b'{"arguments": {"expression": "2+2"}}', "application/vnd.api+json"),
    (b'{"arguments": {"expression": "2+2"}}', "text/plain"),
    (b'{"arguments": {"expression": "2+2"}}', None),
    ('{"arguments": {"expression": "2+2"}}'.encode("utf-16"), "application/json"),
    (b'{"arguments": {"expression": "\xff"}}', "application/json"),
]
PICK_BODIES = [
    b'{"arguments": {"n": 3, "tags": ["a", "b"], "flag": true}}',
    b'{"arguments": {"n": "3", "flag": "yes"}}',  # lax coercion, as FastAPI does it
    b'{"arguments": {"n": 3.0}}',
    b'{"arguments": {"n": 3.5}}',
    b'{"arguments": {"n": 10}}',
    b'{"arguments": {"n": 1, "tags": "a"}}',
    b'{"arguments": {"n": 1, "n": 2}}',  # duplicate keys: the last wins in both parsers
]


def _comparable(r: httpx.Response) -> tuple[int, object]:
    body = r.json()
    if isinstance(body, dict) and isinstance(body.get("seconds"), float):
        body["seconds"] = 0.0
    return r.status_code, body


async def test_fast_path_answers_as_the_fastapi_route():
    fast, slow = _apps()
    cases = [("/tools/calculator/call", b, ct) for b, ct in BODIES]
    cases += [("/tools/pick/call", b, "application/json") for b in PICK_BODIES]
    async with (
        httpx.AsyncClient(transport=httpx.ASGITransport(fast), base_url="http://t", headers=AUTH) as f,
        httpx.AsyncClient(transport=httpx.ASGITransport(slow), base_url="http://t", headers=AUTH) as s,
    ):
        for path, body, ct in cases:
            headers = {"content-type": ct} if ct else {}
            a = await f.post(path, content=body, headers=headers)
            b = await s.post(path, content=body, headers=headers)
            assert _comparable(a) == _comparable(b), (path, body[:60], ct)
            assert a.headers["content-type"] == b.headers["content-type"]
        for path, method in [("/tools/calculator/call", "GET"), ("/tools/nope/call", "POST")]:
            a, b = await f.request(method, path), await s.request(method, path)
            assert _comparable(a) == _comparable(b)
        r = await f.post(
            "/tools/calculator/call", json={"arguments": {"expression": "1"}}, headers={"Authorization": ""}
        )
        assert r.status_code == 401  # the fast path sits behind auth


async def test_fast_path_is_taken_for_valid_calls_and_keeps_limits():
    fast, _ = _apps(limits=ServerLimits(max_sessions=1, max_body_bytes=1000))
    # with the FastAPI call routes gone, only the fast path can answer a valid call
    fast.router.routes = [r for r in fast.router.routes if getattr(r, "path", "") != "/tools/calculator/call"]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(fast), base_url="http://t", headers=AUTH) as http:
        r = await http.post("/tools/calculator/call", json={"arguments": {"expression": "6*7"}})
        assert r.status_code == 200 and r.json()["content"] == "42"
        r = await http.post("/tools/calculator/call", json={"arguments": {"expression": "1"}, "session_id": "a"})
        assert r.status_code == 200
        r = await http.post("/tools/calculator/call", json={"arguments": {"expression": "1"}, "session_id": "b"})
        assert r.status_code == 429 and "too many open sessions" in r.json()["detail"]

        async def chunks():  # no Content-Length: counted as it streams in
            for _ in range(5):
                yield b" " * 400

        r = await http.post("/tools/calculator/call", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and "1000 bytes" in r.json()["detail"]


# ---------------------------------------------------------------- the client against scripted servers


class Scripted:
    """A raw HTTP/1.1 server: `await answer(request_index, conn_index, request)` gives the bytes to send (None:
    close without answering; a `Connection: close` or HTTP/1.0 answer is followed by a close)."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.requests = 0
        self.connections = 0
        self.open = 0
        self.max_open = 0
        self.writers: list[asyncio.StreamWriter] = []
        self.tasks: list[asyncio.Task] = []

    def drop_idle(self) -> None:
        for w in self.writers:
            w.close()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = self.connections
        self.connections += 1
        self.open += 1
        self.max_open = max(self.max_open, self.open)
        self.writers.append(writer)
        self.tasks.append(asyncio.current_task())
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                length = next(
                    (int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")), 0
                )
                body = await reader.readexactly(length)
                i = self.requests
                self.requests += 1
                out = await self.answer(i, conn, head + body)
                if out is None:
                    return
                writer.write(out)
                await writer.drain()
                if b"Connection: close" in out or out.startswith(b"HTTP/1.0"):
                    return
        finally:
            self.open -= 1
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


RESULT = json.dumps({"content": "ok", "ok": True}).encode()


def ok(extra: bytes = b"", body: bytes = RESULT) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        + extra
        + b"content-length: %d\r\n\r\n" % len(body)
        + body
    )


async def test_client_reads_every_answer_shape():
    shapes = [
        ok(),
        b"HTTP/1.1 100 Continue\r\n\r\n" + ok(),
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;x=1\r\n"
        + RESULT[:5]
        + b"\r\n%x\r\n" % (len(RESULT) - 5)
        + RESULT[5:]
        + b"\r\n0\r\nTrailer: t\r\n\r\n",
        ok(b"Connection: close\r\n"),
        b"HTTP/1.0 200 OK\r\ncontent-type: application/json\r\n\r\n" + RESULT,  # no length: ends at close
    ]

    async def answer(i: int, conn: int, request: bytes) -> bytes | None:
        assert request.startswith(b"POST /base/tools/t/call HTTP/1.1\r\n") and b"Authorization: Bearer k" in request
        assert request.endswith(b'{"arguments":{"x":"\xc3\xa9"},"session_id":"s/1"}')
        return shapes[i % len(shapes)]

    server = Scripted(answer)
    async with server as url, ToolClient(url + "/base/", token="k") as c:
        for _ in range(2 * len(shapes)):
            r = await c.call("t", {"x": "é"}, "s/1")
            assert r.ok and r.content == "ok", r
    assert server.connections == 4  # kept alive but across the `close` and HTTP/1.0 answers (2 rounds of 5)


async def test_client_resends_on_connections_closed_while_idle_and_retries_dropped_ones():
    dropped = Scripted(lambda i, conn, req: _async(None if i == 0 else ok()))  # a new connection, no answer
    async with dropped as url:
        async with ToolClient(url, retries=0) as c:
            r = await c.call("t", {})
            assert not r.ok and "ServerDisconnectedError" in r.error
        async with ToolClient(url, retries=2, backoff_s=0.001) as c:
            assert (await c.call("t", {})).ok and dropped.requests == 2  # retried: the request never got an answer

    idle_closes = Scripted(lambda i, conn, req: _async(ok()))
    async with idle_closes as url, ToolClient(url, retries=1, backoff_s=0.001) as c:
        assert (await c.call("t", {})).ok
        idle_closes.drop_idle()  # the server closes idle keep-alive connections (uvicorn does after 5 s)
        assert (await c.call("t", {})).ok  # on a new connection: the server answered each request once
        assert idle_closes.connections == 2 and idle_closes.requests == 2

    # the server closes a kept-alive connection as the request is sent: a POST is not resent silently (RFC 9112
    # 9.3.1), it is a retry like any dropped request
    racing = Scripted(lambda i, conn, req: _async(None if i == 1 else ok()))
    async with racing as url, ToolClient(url, retries=0) as c:
        assert (await c.call("t", {})).ok
        r = await c.call("t", {})
        assert not r.ok and "ServerDisconnectedError" in r.error
    racing = Scripted(lambda i, conn, req: _async(None if i == 1 else ok()))
    async with racing as url, ToolClient(url, retries=1, backoff_s=0.001) as c:
        assert (await c.call("t", {})).ok
        assert (await c.call("t", {})).ok and racing.requests == 3 and racing.connections == 2


async def _async(value):
    return value


async def test_client_timeouts_errors_and_pool_limit():
    async def slow(i: int, conn: int, request: bytes) -> bytes | None:
        await asyncio.sleep(0.1 if b'"n":1' in request else 2.0)
        return ok()

    server = Scripted(slow)
    async with server as url, ToolClient(url, timeout_s=10, max_connections=2, retries=3) as c:
        r = await c.call("t", {"n": 2}, timeout_s=0.2)
        assert not r.ok and "timed out" in r.error and server.requests == 1  # a read timeout is never retried
        results = await asyncio.gather(*(c.call("t", {"n": 1}) for _ in range(8)))
        assert all(r.ok for r in results) and server.max_open <= 3  # 2 + the abandoned timed-out one

    server = Scripted(slow)
    async with server as url, ToolClient(url, max_connections=1, retries=0) as c:
        first = asyncio.create_task(c.call("t", {"n": 1}))
        await until(lambda: server.requests == 1, "the first call to hold the connection")
        r = await c.call("t", {"n": 1}, timeout_s=0.03)  # the one connection is busy for 0.1 s
        assert not r.ok and "timed out" in r.error
        waiting = asyncio.create_task(c.call("t", {"n": 1}))
        await until(lambda: waiting in c._inflight, "the call to wait for the one connection")
        waiting.cancel()  # a request cancelled while queued gives up its place, and no slot leaks
        assert (await first).ok
        assert all(r.ok for r in await asyncio.gather(*(c.call("t", {"n": 1}) for _ in range(3))))

    garbage = Scripted(lambda i, conn, req: _async(b"HTTX/9 what\r\n\r\n"))
    async with garbage as url, ToolClient(url, retries=0) as c:
        r = await c.call("t", {})
        assert not r.ok and "malformed answer" in r.error and "HTTX/9" in r.error

    busy = Scripted(lambda i, conn, req: _async(b"HTTP/1.1 503 Busy\r\nRetry-After: 0\r\ncontent-length: 0\r\n\r\n"))
    async with busy as url, ToolClient(url, retries=2, backoff_s=0.001) as c:
        r = await c.call("t", {})
        assert not r.ok and "answered 503" in r.error and busy.requests == 3
        with pytest.raises(Exception, match="503"):
            await c.health()

    async with ToolClient("http://127.0.0.1:9", retries=1, backoff_s=0.001) as c:
        r = await c.call("t", {})
        assert not r.ok and "unreachable" in r.error and "ClientConnectorError" in r.error
        r = await c.call("t", {"x": float("nan")})
        assert not r.ok and "not JSON" in r.error


async def test_client_retries_5xx_and_dropped_requests_only():
    script: list[bytes | float | None] = []

    async def answer(i: int, conn: int, request: bytes) -> bytes | None:
        step = script.pop(0)
        if isinstance(step, float):  # answer too late
            await asyncio.sleep(step)
            return ok()
        return step

    def status(code: int, extra: bytes = b"") -> bytes:
        body = b'{"detail": "x"}'
        return b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n%s\r\n%s" % (code, len(body), extra, body)

    server = Scripted(answer)
    async with server as url, ToolClient(url, retries=3, backoff_s=0.001) as c:
        script[:] = [status(503, b"Retry-After: 0\r\n"), None, status(500), ok()]
        assert (await c.call("t", {})).ok and server.requests == 4
        script[:] = [status(500)] * 4
        r = await c.call("t", {})
        assert not r.ok and "answered 500" in r.error and server.requests == 8
        script[:] = [status(400)]
        r = await c.call("t", {})
        assert not r.ok and "answered 400" in r.error and server.requests == 9  # client errors are not retried
        script[:] = [1.0]
        r = await c.call("t", {}, timeout_s=0.1)
        assert not r.ok and "timed out" in r.error and server.requests == 10  # the tool may be running: no retry
    async with server as url, ToolClient(url, timeout_s=0.1, retries=3) as c:
        script[:] = [1.0]
        r = await c.call("t", {})  # the client's own timeout, whole-request
        assert not r.ok and "timed out" in r.error and server.requests == 11


async def test_client_connection_limit_and_reuse():
    async def answer(i: int, conn: int, request: bytes) -> bytes | None:
        await asyncio.sleep(0.001)
        return ok()

    server = Scripted(answer)
    async with server as url, ToolClient(url, max_connections=8) as c:
        for _ in range(3):
            assert all(r.ok for r in await asyncio.gather(*(c.call("t", {}) for _ in range(64))))
        assert server.requests == 192 and server.max_open <= 8 and server.connections <= 8  # kept alive


async def test_client_honours_proxy_env(monkeypatch):
    async def as_proxy(i: int, conn: int, request: bytes) -> bytes | None:
        assert request.startswith(b"POST http://tools.internal:8000/tools/t/call HTTP/1.1\r\n"), request[:80]
        return ok()

    proxy = Scripted(as_proxy)
    direct = Scripted(lambda i, conn, req: _async(ok()))
    for name in ("NO_PROXY", "no_proxy", "http_proxy", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    async with proxy as proxy_url, direct as direct_url:
        monkeypatch.setenv("HTTP_PROXY", proxy_url)
        async with ToolClient("http://tools.internal:8000") as c:
            assert (await c.call("t", {})).ok and proxy.requests == 1
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        async with ToolClient(direct_url) as c:
            assert (await c.call("t", {})).ok and direct.requests == 1 and proxy.requests == 1


async def test_client_closed_says_so():
    c = ToolClient("http://127.0.0.1:9")
    await c.aclose()
    r = await c.call("t", {})
    assert not r.ok and "closed" in r.error


def test_client_survives_a_new_event_loop():
    app = create_app([calculator])
    with ServerThread(app) as url:
        client = ToolClient(url)

        async def one() -> str:
            return (await client.call("calculator", {"expression": "6*7"})).content

        assert asyncio.run(one()) == "42"
        assert asyncio.run(one()) == "42"  # the first loop's connections are left behind, not reused
        asyncio.run(client.aclose())  # from yet another loop: no unclosed-session warning


async def test_client_against_the_real_server_at_64_concurrent_calls():
    app = create_app([calculator], token=TOKEN)
    with ServerThread(app) as url:
        async with ToolClient(url, token=TOKEN) as c:
            clients = asyncio.Semaphore(64)

            async def one(i: int) -> str:
                async with clients:
                    return (await c.call("calculator", {"expression": f"{i}*2"})).content

            results = await asyncio.gather(*(one(i) for i in range(640)))
            assert results == [str(i * 2) for i in range(640)]
            tools = await c.list_tools()
            assert tools[0]["function"]["name"] == "calculator"
            await c.open_session("train/x/0")
            await c.close_session("train/x/0")
            r = await c.call("calculator", {"expr": "1"})
            assert not r.ok and "expression" in r.error  # the 422 from the route, described
