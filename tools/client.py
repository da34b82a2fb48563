"""Async client for `agentrl serve-tools`, used by env managers through `Toolbox` (url: tools).

One keep-alive connection pool per server and event loop: an aiohttp session (HTTP/1.1, https://, the proxies
that HTTP(S)_PROXY / NO_PROXY name). The protocol is aiohttp's, never parsed here (a hand-written HTTP/1.1 pool
once saved ~40 us of client CPU per call; `benchmarks/bench_tools.py` measures this client at the server's own
rate, 85 us of CPU per call).

Retries (exponential backoff with jitter) happen only where a retry is safe or the server asks for
it: connection errors (the request never reached the tool, or the server dropped the connection without
answering) and 5xx answers (including 503 "busy", honouring Retry-After). A timeout is never retried: the tool
may be running. Every failure comes back as a `ToolResult(ok=False)` whose content tells the model what happened.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import time
from typing import Any
from urllib.parse import quote

import aiohttp
from aiohttp.helpers import get_env_proxy_for_url
from multidict import CIMultiDictProxy
from yarl import URL

from agentrl.tools.core import ToolResult


def token_from_env(var: str | None, what: str) -> str | None:
    """The bearer token held by environment variable `var` (None: no auth). Config files name the variable, never
    the secret; `what` names the setting in the error."""
    if var is None:
        return None
    token = os.environ.get(var)
    if not token:
        raise ValueError(f"{what}: the environment variable {var} is not set or empty")
    return token


class Answer:
    """An answer read whole: status_code, headers (`.get(name)`, case-insensitive), content, text, json()."""

    __slots__ = ("content", "headers", "status_code")

    def __init__(self, status_code: int, headers: CIMultiDictProxy[str], content: bytes) -> None:
        self.status_code = status_code
        self.headers = headers
        self.content = content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)


# The request never reached the tool, or the server dropped it unanswered: safe to send again. A timeout
# (asyncio.TimeoutError, aiohttp.ServerTimeoutError) is not: the tool may be running.
_RETRYABLE_EXC: tuple[type[BaseException], ...] = (
    aiohttp.ClientConnectorError,  # refused, unreachable, DNS (also proxy connection errors)
    aiohttp.ConnectionTimeoutError,  # connecting took over the connect timeout
    aiohttp.ServerDisconnectedError,  # closed without (a whole) answer
    aiohttp.ClientPayloadError,  # closed in the middle of its answer
    aiohttp.ClientResponseError,  # with raise_for_status=False only a malformed answer raises this
)
_TIMEOUT_EXC = (asyncio.TimeoutError, aiohttp.ServerTimeoutError)  # ConnectionTimeoutError is caught first
_HTTP_EXC = (aiohttp.ClientError, asyncio.TimeoutError)
_JSON_HEADERS = {"Content-Type": "application/json"}


class ToolServerError(RuntimeError):
    """A management call (list tools, sessions, health) failed after retries."""


@functools.lru_cache(maxsize=64)
def _timeout(total: float) -> aiohttp.ClientTimeout:
    """Whole-request timeout (waiting for a pooled connection included); connecting alone at most 5 s."""
    return aiohttp.ClientTimeout(total=total, sock_connect=min(5.0, total))


KEEPALIVE_S = 4.0  # under uvicorn's 5 s, so the client drops idle connections first


class _AiohttpTransport:
    """An aiohttp session to one server: keep-alive pool, https://, proxies from the environment (and the proxy's
    ~/.netrc login)."""

    def __init__(self, base_url: str, headers: dict[str, str], max_connections: int) -> None:
        self.base_url = base_url
        self._urls: dict[str, URL] = {}
        connector = aiohttp.TCPConnector(
            limit=max_connections,  # one server per client: the per-host limit is the same
            limit_per_host=max_connections,
            force_close=False,
            keepalive_timeout=KEEPALIVE_S,
            ttl_dns_cache=300,
        )
        try:  # read once as httpx did
            proxy, proxy_auth = get_env_proxy_for_url(URL(base_url))
        except LookupError:
            proxy, proxy_auth = None, None
        self.session = aiohttp.ClientSession(
            connector=connector,
            headers=headers,
            raise_for_status=False,
            # not trust_env=True: it looks the proxy up again on every request, in a worker thread
            proxy=proxy,
            proxy_auth=proxy_auth,
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    def _url(self, path: str) -> URL:
        url = self._urls.get(path)
        if url is None:
            url = URL(self.base_url + path)
            if len(self._urls) < 4096:
                self._urls[path] = url
        return url

    async def request(self, method: str, path: str, body: bytes | None, timeout_s: float) -> Answer:
        """One attempt, its answer read whole."""
        async with self.session.request(
            method,
            self._url(path),
            data=body,
            headers=_JSON_HEADERS if body is not None else None,
            timeout=_timeout(timeout_s),
            allow_redirects=False,
        ) as resp:
            return Answer(resp.status, resp.headers, await resp.read())

    async def aclose(self) -> None:
        await self.session.close()

    def abandon(self) -> None:
        if self.session.connector is not None:
            self.session.connector._close()  # of a finished loop: its connections died with it


def _describe_exc(err: BaseException) -> str:
    if isinstance(err, aiohttp.ClientResponseError):  # a malformed answer: aiohttp's parser says what was wrong
        return f"malformed answer: {err.message}"
    return f"{type(err).__name__}: {err}"


class ToolClient:
    """Talks to one tool server. Safe to share between many concurrent episodes (of one event loop; a client
    used from a new event loop opens a new pool there and closes the previous loop's: connections belong to one
    loop)."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.05,
        max_connections: int = 256,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_connections = max_connections
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._pool: _AiohttpTransport | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._inflight: set[asyncio.Task] = set()  # requests under way, which aclose() lets finish

    def _transport(self) -> _AiohttpTransport:
        loop = asyncio.get_running_loop()
        transport = self._pool
        if self._loop is loop and transport is not None:
            return transport
        if self._closed:
            raise aiohttp.ClientConnectionError("ToolClient is closed")
        if transport is not None:
            transport.abandon()  # of another (often finished) loop: its connections cannot serve this one
        transport = _AiohttpTransport(self.base_url, self._headers, self.max_connections)
        self._pool, self._loop = transport, loop
        return transport

    async def _request(self, method: str, path: str, timeout_s: float | None = None, json: Any = None) -> Answer:
        """Send, retrying connection errors and 5xx; returns the last response or raises the last error."""
        body = _dumps(json) if json is not None else None
        task = asyncio.current_task()
        if task is not None:
            self._inflight.add(task)
        try:
            return await self._attempts(method, path, body, timeout_s)
        finally:
            self._inflight.discard(task)  # type: ignore[arg-type]

    async def _attempts(self, method: str, path: str, body: bytes | None, timeout_s: float | None) -> Answer:
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                resp = await self._transport().request(method, path, body, timeout_s or self.timeout_s)
            except _RETRYABLE_EXC:
                if last:
                    raise
                await asyncio.sleep(self._delay(attempt))
                continue
            if resp.status_code < 500 or last:
                return resp
            await asyncio.sleep(self._delay(attempt, resp.headers.get("retry-after")))
        raise AssertionError("unreachable")  # pragma: no cover

    def _delay(self, attempt: int, retry_after: str | None = None) -> float:
        delay = self.backoff_s * (2**attempt) * (0.5 + random.random())
        if retry_after:
            try:
                delay = max(delay, min(float(retry_after), 5.0))
            except ValueError:
                pass
        return delay

    async def call(
        self,
        name: str,
        arguments: dict[str, Any],
        session_id: str | None = None,
        timeout_s: float | None = None,
    ) -> ToolResult:
        """Call a tool; never raises for failures (unreachable server, 4xx/5xx, timeouts)."""
        start = time.perf_counter()
        body = {"arguments": arguments, "session_id": session_id}
        try:
            resp = await self._request("POST", _call_path(name), timeout_s=timeout_s, json=body)
        except _TIMEOUT_EXC:
            return ToolResult.failure(f"{name} timed out waiting for the tool server", time.perf_counter() - start)
        except aiohttp.ClientError as err:
            msg = f"tool server unreachable for {name}: {_describe_exc(err)}"
            return ToolResult.failure(msg, time.perf_counter() - start)
        except (TypeError, ValueError) as err:  # arguments json cannot encode (NaN, objects)
            return ToolResult.failure(f"arguments of {name} are not JSON: {err}", time.perf_counter() - start)
        elapsed = time.perf_counter() - start
        if resp.status_code == 200:
            try:
                return _validate_result(resp.content)
            except ValueError:
                return ToolResult.failure(f"tool server sent a malformed result for {name}", elapsed)
        return ToolResult.failure(_describe_error(name, resp), elapsed)

    async def list_tools(self) -> list[dict[str, Any]]:
        """The server's OpenAI function schemas."""
        return (await self._checked("GET", "/tools")).json()["tools"]

    async def open_session(self, session_id: str) -> None:
        await self._checked("POST", "/sessions/open", json={"session_id": session_id})

    async def close_session(self, session_id: str) -> None:
        await self._checked("POST", "/sessions/close", json={"session_id": session_id})

    async def health(self) -> dict[str, Any]:
        return (await self._checked("GET", "/health")).json()

    async def _checked(self, method: str, path: str, **kw: Any) -> Answer:
        try:
            resp = await self._request(method, path, **kw)
        except _HTTP_EXC as err:
            raise ToolServerError(f"{method} {self.base_url}{path}: {_describe_exc(err)}") from err
        if resp.status_code >= 400:
            raise ToolServerError(f"{method} {self.base_url}{path}: {_describe_error('', resp)}")
        return resp

    async def aclose(self) -> None:
        """Refuse new calls, let the ones under way (or queued for a connection) finish, then close the pool."""
        self._closed = True
        transport, self._pool = self._pool, None
        if transport is not None:
            if self._loop is asyncio.get_running_loop():
                pending = {t for t in self._inflight if t is not asyncio.current_task() and not t.done()}
                if pending:
                    await asyncio.wait(pending, timeout=self.timeout_s)
                await transport.aclose()
            else:
                transport.abandon()  # of another loop

    async def __aenter__(self) -> ToolClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


_validate_result = ToolResult.__pydantic_validator__.validate_json  # model_validate_json minus its wrapper
_encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)  # compact, UTF-8, no NaN


def _dumps(obj: Any) -> bytes:
    return _encoder.encode(obj).encode()


@functools.lru_cache(maxsize=1024)
def _call_path(name: str) -> str:
    return f"/tools/{quote(name, safe='')}/call"


def _describe_error(name: str, resp: Answer) -> str:
    """Turn an HTTP error answer into one line the model (or a person) can act on."""
    try:
        detail = resp.json().get("detail", resp.text)
    except (ValueError, AttributeError):
        detail = resp.text
    if resp.status_code == 422 and isinstance(detail, list):  # FastAPI validation: name the fields
        parts = []
        for e in detail:
            loc = [str(p) for p in e.get("loc", []) if p not in ("body", "arguments")]
            parts.append(f"{'.'.join(loc) or 'arguments'}: {e.get('msg', '')}")
        return f"invalid arguments for {name}: " + "; ".join(parts)
    prefix = f"{name}: " if name else ""
    return f"{prefix}tool server answered {resp.status_code}: {str(detail)[:300]}"
