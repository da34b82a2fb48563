"""A lean keep-alive HTTP/1.1 connection pool on asyncio, behind `ToolClient`'s calls to plain http:// servers.

A tool call is one small request and one small answer, so the per-call cost of a general-purpose client
(aiohttp: ~100 us of client CPU per call) would cap an env manager well below what the tool server answers. Here
a request is one `transport.write` (the header block is encoded once per path; only Content-Length and the body
change) and the answer is parsed by httptools (llhttp, uvicorn's parser): status, headers, Content-Length or
chunked bodies, 1xx interim answers, HTTP/1.0 and `Connection: close` (the connection is then not reused), a body
that ends when the server closes. Failures raise aiohttp's exceptions, so `ToolClient` classifies both transports
the same way: `ClientConnectorError` (cannot connect), `ConnectionTimeoutError` (connecting took over 5 s),
`ServerDisconnectedError` (closed before answering, e.g. a kept-alive connection the server had just closed),
`ClientPayloadError` (closed in the middle of an answer), `ClientResponseError` (a malformed answer).

Connections are reused last-in first-out; one idle for `keepalive_s` (under uvicorn's 5 s) is closed rather than
reused, and one the server closed while idle leaves the pool as soon as the close is seen. At most `limit`
connections are open; further requests queue for one, first come first served. A request that does not finish
(timeout, cancellation, error) closes its connection: an answer may still be on its way.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from collections import deque
from collections.abc import Mapping
from typing import Any, NamedTuple

import aiohttp
import httptools
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

if sys.version_info >= (3, 11):
    from asyncio import timeout as _timeout
    from asyncio import timeout_at as _timeout_at
else:  # pragma: no cover - aiohttp requires async-timeout below 3.11
    from async_timeout import timeout as _timeout
    from async_timeout import timeout_at as _timeout_at

CONNECT_TIMEOUT_S = 5.0
TICKS_PER_S = 100  # answers' deadlines are kept to 10 ms (a timeout fires up to 10 ms late)


class Answer:
    """An answer read whole: status_code, headers (`.get(name)`, case-insensitive), content, text, json()."""

    __slots__ = ("content", "headers", "status_code")

    def __init__(self, status_code: int, headers: Headers | Mapping[str, str], content: bytes) -> None:
        self.status_code = status_code
        self.headers = headers
        self.content = content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)


class Headers:
    """An answer's header lines as received; `get(name)` is case-insensitive (the last line of a name wins)."""

    __slots__ = ("raw",)

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = raw

    def get(self, name: str, default: str | None = None) -> str | None:
        key = name.lower().encode("latin-1")
        for k, v in reversed(self.raw):
            if k.lower() == key:
                return v.decode("latin-1")
        return default

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None

    def __repr__(self) -> str:
        return f"Headers({self.raw!r})"


class _Key(NamedTuple):  # what aiohttp.ClientConnectorError reads from its connection key
    host: str
    port: int
    ssl: bool = False


class _Conn(asyncio.Protocol):
    """One connection: at most one request in flight (`waiter`), its answer parsed as it arrives."""

    def __init__(self, pool: Http1Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[Answer] | None = None
        self.lost = False
        self.counted = False  # holds one of the pool's `limit` slots (from when connecting succeeded)
        self.keep_alive = False
        self.idle_since = 0.0
        self.raw: list[tuple[bytes, bytes]] = []  # header lines (and trailers)
        self.body: list[bytes] = []
        self.headers_done = False

    # ---------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.waiter is None or self.waiter.done():  # bytes nobody asked for: the connection is unusable
            self.lost = True
            self.transport.close()  # type: ignore[union-attr]
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as err:
            self._fail(_malformed(self.pool, f"{err} in {data[:80]!r}"))
        except httptools.HttpParserUpgrade:
            self._fail(_malformed(self.pool, f"unexpected protocol upgrade in {data[:80]!r}"))

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = True
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            headers = Headers(self.raw)
            sized = "content-length" in headers or "chunked" in (headers.get("transfer-encoding") or "").lower()
            if not self.headers_done:
                waiter.set_exception(aiohttp.ServerDisconnectedError())
            elif sized:
                waiter.set_exception(aiohttp.ClientPayloadError("the server closed the connection mid-answer"))
            else:  # no length given: the body ends where the server closes the connection
                self.keep_alive = False
                waiter.set_result(Answer(self.parser.get_status_code(), headers, b"".join(self.body)))
        self.pool._lost(self)

    # ---------------------------------------------------------------- httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self.raw.append((name, value))

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # 1xx (100 Continue): the answer follows
            self.raw, self.body, self.headers_done = [], [], False
            return
        self.keep_alive = self.parser.should_keep_alive()
        body = self.body
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(Answer(status, Headers(self.raw), body[0] if len(body) == 1 else b"".join(body)))
        else:  # an answer nobody waits for (any more): the connection is out of step, not reusable
            self.lost = True
            self.transport.close()  # type: ignore[union-attr]

    # ----------------------------------------------------------------

    def _fail(self, err: BaseException) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(err)
        self.transport.close()  # type: ignore[union-attr]


def _malformed(pool: Http1Pool, message: str) -> aiohttp.ClientResponseError:
    url = URL.build(scheme="http", host=pool.host, port=pool.port)
    info = aiohttp.RequestInfo(url, "", CIMultiDictProxy(CIMultiDict()), url)
    return aiohttp.ClientResponseError(info, (), status=0, message=message)


class Http1Pool:
    """Keep-alive connections to one http:// server, for the event loop that created the pool."""

    def __init__(self, base_url: URL, headers: dict[str, str], limit: int, keepalive_s: float = 4.0) -> None:
        if base_url.scheme != "http" or not base_url.raw_host:
            raise ValueError(f"Http1Pool serves plain http:// URLs, not {base_url}")
        self.loop = asyncio.get_running_loop()
        self.host = base_url.raw_host.strip("[]")
        self.port = base_url.port or 80
        self.base_path = base_url.raw_path.rstrip("/")
        host_header = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 literal in brackets
        if self.port != 80:
            host_header += f":{self.port}"
        fixed = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self._fixed = f"Host: {host_header}\r\n{fixed}".encode("latin-1")
        self.limit = limit
        self.keepalive_s = keepalive_s
        self.open = 0  # connections holding a slot: connecting, in use or idle
        self.idle: list[_Conn] = []
        self.waiters: deque[asyncio.Future[_Conn | None]] = deque()
        self.closed = False
        self._heads: dict[tuple[str, str], bytes] = {}
        self._due: dict[int, set[asyncio.Future[Answer]]] = {}  # 10 ms tick -> answers due by then

    def _head(self, method: str, path: str) -> bytes:
        head = self._heads.get((method, path))
        if head is None:
            head = f"{method} {self.base_path}{path} HTTP/1.1\r\n".encode("latin-1") + self._fixed
            if len(self._heads) < 4096:
                self._heads[(method, path)] = head
        return head

    async def request(self, method: str, path: str, body: bytes | None, timeout_s: float) -> Answer:
        """One attempt, the answer read whole, all of it (waiting for a connection included) within timeout_s;
        raises asyncio.TimeoutError or one of aiohttp's ClientErrors (see the module docstring)."""
        head = self._head(method, path)
        if body is None:
            data = head + b"\r\n"
        else:
            data = b"%sContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (head, len(body), body)
        loop = self.loop
        deadline = loop.time() + timeout_s
        conn = self._take_idle()
        if conn is None:
            async with _timeout_at(deadline):
                conn = await self._acquire()
                while conn.lost:  # the server closed it as it was handed over, before any use: take another
                    self._drop(conn)
                    conn = self._take_idle() or await self._acquire()
        reuse = False
        waiter = conn.waiter = loop.create_future()
        # the answer's deadline: answers due in the same 10 ms share one timer (a timer per request costs ~2 us)
        tick = int(deadline * TICKS_PER_S) + 1
        due = self._due.get(tick)
        if due is None:
            due = self._due[tick] = set()
            loop.call_at(tick / TICKS_PER_S, self._expire, tick)
        due.add(waiter)
        try:
            conn.raw, conn.body, conn.headers_done = [], [], False
            conn.transport.write(data)  # type: ignore[union-attr]
            answer = await waiter
            reuse = conn.keep_alive
            return answer
        finally:
            due.discard(waiter)
            conn.waiter = None
            self._release(conn, reuse)

    def _expire(self, tick: int) -> None:
        for waiter in self._due.pop(tick, ()):
            if not waiter.done():
                waiter.set_exception(asyncio.TimeoutError())

    # ---------------------------------------------------------------- the pool

    def _take_idle(self) -> _Conn | None:
        """The most recently used idle connection, if one is fresh (too long idle ones are closed)."""
        idle = self.idle
        if idle:
            now = self.loop.time()
            while idle:
                conn = idle.pop()
                if now - conn.idle_since < self.keepalive_s and not conn.lost:
                    return conn
                self._drop(conn)
        return None

    async def _acquire(self) -> _Conn:
        """A new connection, or one handed over when the pool is full."""
        if self.closed:
            raise aiohttp.ClientConnectionError("ToolClient is closed")
        if self.open < self.limit:
            self.open += 1
            return await self._connect()
        waiter: asyncio.Future[_Conn | None] = self.loop.create_future()
        self.waiters.append(waiter)
        try:
            conn = await waiter  # a connection handed over, or None: a free slot (already counted) to connect on
        except BaseException:
            # handed over just as this request gave up (timeout, cancelled): pass it on
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                got = waiter.result()
                if got is None:
                    self.open -= 1
                    self._wake()
                else:
                    self._release(got, True)
            raise
        return conn if conn is not None else await self._connect()

    async def _connect(self) -> _Conn:
        """A new connection on a slot already counted in `open` (given back if connecting fails)."""
        try:
            try:
                async with _timeout(CONNECT_TIMEOUT_S):
                    _, conn = await self.loop.create_connection(lambda: _Conn(self), self.host, self.port)
                conn.counted = True  # the slot taken for connecting is the connection's now
            except asyncio.TimeoutError as err:  # ours (the caller's whole-request timeout cancels instead)
                raise aiohttp.ConnectionTimeoutError(f"connecting to {self.host}:{self.port} timed out") from err
            except OSError as err:
                raise aiohttp.ClientConnectorError(_Key(self.host, self.port), err) from err  # type: ignore[arg-type]
        except BaseException:
            self.open -= 1
            self._wake()
            raise
        if self.closed:
            self._drop(conn)
            raise aiohttp.ClientConnectionError("ToolClient is closed")
        return conn

    def _release(self, conn: _Conn, reuse: bool) -> None:
        if not reuse or conn.lost or self.closed:
            self._drop(conn)
            return
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        conn.idle_since = self.loop.time()
        self.idle.append(conn)

    def _drop(self, conn: _Conn) -> None:
        """Close a connection and free its slot (once)."""
        if not conn.lost and conn.transport is not None:
            conn.lost = True
            conn.transport.close()
        if conn.counted:
            conn.counted = False
            self.open -= 1
            self._wake()

    def _wake(self) -> None:
        """A slot came free: the first queued request takes it and connects."""
        while self.waiters and self.open < self.limit:
            waiter = self.waiters.popleft()
            if not waiter.done():
                self.open += 1
                waiter.set_result(None)
                return

    def _lost(self, conn: _Conn) -> None:
        """The connection closed (server or us); if it was idle it leaves the pool now."""
        if conn.waiter is None:
            try:
                self.idle.remove(conn)
            except ValueError:
                pass
            self._drop(conn)

    # ---------------------------------------------------------------- closing

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Close idle connections now (those in use close as their requests end); queued requests fail."""
        self.closed = True
        idle, self.idle = self.idle, []
        for conn in idle:
            self._drop(conn)
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_exception(aiohttp.ClientConnectionError("ToolClient is closed"))

    def abandon(self) -> None:
        """Close the pool from outside its event loop (the client moved to another loop)."""
        self.closed = True
        if not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(self.close)
                return
            except RuntimeError:  # closed meanwhile
                pass
        for conn in self.idle:  # its loop is gone: end the connections at the socket, the loop cannot
            sock: Any = conn.transport.get_extra_info("socket") if conn.transport is not None else None
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except (OSError, AttributeError):
                    pass
        self.idle = []
