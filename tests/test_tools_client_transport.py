"""`ToolClient`'s transport (an aiohttp session) against real uvicorn servers and scripted raw ones: keep-alive
reuse, servers that close idle connections, Retry-After, timeouts (never retried), malformed, truncated and chunked
answers, a 64-call burst, use from two event loops, https://. Everything asserts behaviour (answers, request and
connection counts as the servers see them), not time.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from agentrl.tools import ToolClient, ToolServerError, tool
from agentrl.tools.calculator import calculator
from agentrl.tools.client import _AiohttpTransport
from agentrl.tools.serve import ServerThread
from agentrl.tools.server import create_app
from tests.servers import until

RESULT = {"content": "ok", "ok": True, "error": None, "seconds": 0.0}


def counting(app, ports: list[int]):
    """The ASGI app, noting the client port of every request: one port per connection the client opened."""

    async def wrapped(scope, receive, send):
        if scope["type"] == "http":
            ports.append(scope["client"][1])
        await app(scope, receive, send)

    return wrapped


def scripted_asgi(answers: list, seen: list[bytes]):
    """A bare ASGI app: the i-th request gets answers[i] (then the last one again): (status, headers, [body parts])."""

    async def app(scope, receive, send):
        if scope["type"] != "http":  # lifespan
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        seen.append(body)
        status, headers, parts = answers[min(len(seen), len(answers)) - 1]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        for i, part in enumerate(parts):
            await send({"type": "http.response.body", "body": part, "more_body": i < len(parts) - 1})

    return app


class RawServer:
    """Answers every request with `answer(i)` (bytes; None: close without answering), then closes."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.requests = 0
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                (int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")), 0
            )
            await reader.readexactly(length)
            i, self.requests = self.requests, self.requests + 1
            out = self.answer(i)
            if out is not None:
                writer.write(out)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()


async def test_keep_alive_reuses_one_connection():
    ports: list[int] = []
    with ServerThread(counting(create_app([calculator]), ports)) as url:
        async with ToolClient(url) as c:
            for i in range(20):
                assert (await c.call("calculator", {"expression": f"{i}+1"})).content == str(i + 1)
            assert (await c.health())["status"] == "ok"
            assert [t["function"]["name"] for t in await c.list_tools()] == ["calculator"]
            await c.open_session("s/1")
            await c.close_session("s/1")
    assert len(ports) == 24 and len(set(ports)) == 1


async def test_server_closing_idle_connections_gets_a_fresh_one():
    ports: list[int] = []
    srv = ServerThread(counting(create_app([calculator]), ports))
    srv.server.config.timeout_keep_alive = 0.05  # uvicorn closes idle connections after 5 s; here at once
    with srv as url:
        async with ToolClient(url, retries=1) as c:
            for _ in range(3):
                assert (await c.call("calculator", {"expression": "6*7"})).content == "42"
                await until(lambda: not srv.server.server_state.connections, "the server to close the connection")
    assert len(ports) == 3 and len(set(ports)) == 3  # each call on a fresh connection, none answered twice


async def test_stale_connection_is_retried_on_a_fresh_one():
    # the server drops a kept-alive connection as the request arrives (before any byte of answer): retried, on a
    # new connection, as a connection error (counted against `retries`: a POST is never resent silently)
    def answer(i: int) -> bytes | None:
        body = json.dumps(RESULT).encode()
        return None if i == 1 else b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)

    class KeepAlive(RawServer):
        async def handle(self, reader, writer):  # keeps connections open between requests
            self.connections += 1
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    n = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))[15:])
                    await reader.readexactly(n)
                    i, self.requests = self.requests, self.requests + 1
                    out = self.answer(i)
                    if out is None:
                        return
                    writer.write(out)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

    server = KeepAlive(answer)
    async with server as url, ToolClient(url, retries=1, backoff_s=0.001) as c:
        assert (await c.call("t", {})).ok
        assert (await c.call("t", {})).ok
        assert server.requests == 3 and server.connections == 2


async def test_retry_after_on_503_is_honoured():
    seen: list[bytes] = []
    busy = (503, [(b"retry-after", b"0.3"), (b"content-type", b"application/json")], [b'{"detail": "busy"}'])
    good = (200, [(b"content-type", b"application/json")], [json.dumps(RESULT).encode()])
    with ServerThread(scripted_asgi([busy, good], seen)) as url:
        async with ToolClient(url, retries=2, backoff_s=0.001) as c:
            t0 = time.monotonic()
            r = await c.call("t", {"x": 1})
            assert r.ok and r.content == "ok" and len(seen) == 2
            assert time.monotonic() - t0 >= 0.3  # waited as long as the server asked (backoff alone: ~1 ms)
    c = ToolClient("http://127.0.0.1:9", backoff_s=0.001)
    assert c._delay(0, "100") <= 5.0 and c._delay(0, "100") >= 5.0  # capped at 5 s
    assert c._delay(0, "soon") < 0.01  # not a number: the backoff alone


async def test_5xx_exhausted_and_management_errors():
    seen: list[bytes] = []
    with ServerThread(scripted_asgi([(500, [], [b'{"detail": "boom"}'])], seen)) as url:
        async with ToolClient(url, retries=2, backoff_s=0.001) as c:
            r = await c.call("t", {})
            assert not r.ok and "answered 500" in r.error and "boom" in r.error and len(seen) == 3
            with pytest.raises(ToolServerError, match="500"):
                await c.list_tools()
    async with ToolClient("http://127.0.0.1:9", retries=1, backoff_s=0.001) as c:
        with pytest.raises(ToolServerError, match="ClientConnectorError"):
            await c.health()


async def test_timeout_is_not_retried():
    calls = []

    @tool
    async def slow(n: int) -> str:
        """Sleep."""
        calls.append(n)
        await asyncio.sleep(n)
        return "done"

    ports: list[int] = []
    with ServerThread(counting(create_app([slow, calculator]), ports)) as url:
        async with ToolClient(url, retries=3, backoff_s=0.001) as c:
            r = await c.call("slow", {"n": 1}, timeout_s=0.2)
            assert not r.ok and "timed out" in r.error
            assert (await c.call("calculator", {"expression": "1+1"})).content == "2"  # after the timeout
            assert calls == [1]  # one attempt only: the tool may be running
            assert len(set(ports)) == 2  # the timed-out connection was not reused (its answer may still come)


async def test_malformed_truncated_and_odd_answers():
    body = json.dumps(RESULT).encode()
    truncated = RawServer(lambda i: b"HTTP/1.1 200 OK\r\ncontent-length: 500\r\n\r\n" + body)
    async with truncated as url:
        async with ToolClient(url, retries=0) as c:
            r = await c.call("t", {})
            assert not r.ok and "ClientPayloadError" in r.error
        async with ToolClient(url, retries=2, backoff_s=0.001) as c:
            assert not (await c.call("t", {})).ok and truncated.requests == 4  # retried: closed mid-answer

    bad_chunk = RawServer(lambda i: b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nxx\r\n0\r\n\r\n")
    async with bad_chunk as url, ToolClient(url, retries=0) as c:
        r = await c.call("t", {})
        assert not r.ok and "malformed answer" in r.error

    not_json = RawServer(lambda i: b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello")
    async with not_json as url, ToolClient(url, retries=0) as c:
        r = await c.call("t", {})
        assert not r.ok and "malformed result" in r.error

    closes_unanswered = RawServer(lambda i: None)
    async with closes_unanswered as url, ToolClient(url, retries=2, backoff_s=0.001) as c:
        r = await c.call("t", {})
        assert not r.ok and "ServerDisconnectedError" in r.error and closes_unanswered.requests == 3

    until_close = RawServer(lambda i: b"HTTP/1.1 200 OK\r\n\r\n" + body)  # no length: the body ends at the close
    async with until_close as url, ToolClient(url, retries=0) as c:
        assert (await c.call("t", {})).content == "ok"
        assert (await c.call("t", {})).content == "ok" and until_close.connections == 2


async def test_chunked_answers_from_uvicorn():
    seen: list[bytes] = []
    body = json.dumps({**RESULT, "content": "x" * 5000}).encode()
    parts = [body[:7], body[7:3000], body[3000:]]  # no content-length: uvicorn sends it chunked
    ports: list[int] = []
    app = counting(scripted_asgi([(200, [(b"content-type", b"application/json")], parts)], seen), ports)
    with ServerThread(app) as url:
        async with ToolClient(url) as c:
            for _ in range(3):
                r = await c.call("t", {"q": "é"})
                assert r.ok and r.content == "x" * 5000
    assert json.loads(seen[0]) == {"arguments": {"q": "é"}, "session_id": None}
    assert len(set(ports)) == 1  # a chunked answer leaves the connection reusable


@pytest.mark.parametrize("max_connections", [256, 8])
async def test_burst_of_64_concurrent_calls(max_connections):
    ports: list[int] = []
    with ServerThread(counting(create_app([calculator]), ports)) as url:
        async with ToolClient(url, max_connections=max_connections) as c:
            for _ in range(2):
                results = await asyncio.gather(*(c.call("calculator", {"expression": f"{i}*3"}) for i in range(64)))
                assert [r.content for r in results] == [str(i * 3) for i in range(64)]
    assert len(ports) == 128 and len(set(ports)) <= max_connections


def test_use_from_two_event_loops():
    with ServerThread(create_app([calculator])) as url:
        client = ToolClient(url)

        async def one(expr: str) -> str:
            return (await client.call("calculator", {"expression": expr})).content

        other = asyncio.new_event_loop()  # a loop that stays alive, in its own thread
        thread = threading.Thread(target=other.run_forever, daemon=True)
        thread.start()
        try:
            assert asyncio.run_coroutine_threadsafe(one("6*7"), other).result(30) == "42"
            first = client._pool
            assert asyncio.run(one("2*3")) == "6"  # a new pool on this loop; the other loop's is closed there
            assert client._pool is not first and first.session.closed
            assert asyncio.run(one("2*4")) == "8"  # and again on a fresh loop (the previous one has finished)
            assert asyncio.run_coroutine_threadsafe(one("2*5"), other).result(30) == "10"
            asyncio.run_coroutine_threadsafe(client.aclose(), other).result(30)
            assert "closed" in asyncio.run(client.call("calculator", {"expression": "1"})).error
        finally:
            other.call_soon_threadsafe(other.stop)
            thread.join(10)
            other.close()


async def test_https_unreachable_fails_cleanly():
    async with ToolClient("https://127.0.0.1:9", retries=0) as c:
        r = await c.call("t", {})
        assert isinstance(c._pool, _AiohttpTransport)
        assert not r.ok and "unreachable" in r.error and "ClientConnectorError" in r.error


async def test_closing_lets_calls_under_way_finish_and_fails_later_ones():
    @tool
    async def hold(s: float) -> str:
        """Wait."""
        await asyncio.sleep(s)
        return "held"

    with ServerThread(create_app([hold])) as url:
        c = ToolClient(url, max_connections=1, retries=0)
        first = asyncio.create_task(c.call("hold", {"s": 0.3}))
        queued = asyncio.create_task(c.call("hold", {"s": 0}))
        await until(lambda: {first, queued} <= c._inflight, "both calls to be under way")
        pool = c._pool
        await c.aclose()
        done, waited = await asyncio.gather(first, queued)
        assert done.ok and done.content == "held" and waited.ok  # the calls under way (and queued) finished
        assert pool is not None and pool.session.closed  # then the pool closed
        assert "closed" in (await c.call("hold", {"s": 0})).error
