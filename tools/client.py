"""Async client for `agentrl serve-tools`, used by env managers through `Toolbox` (url: tools).

One pooled httpx client per server. Retries (exponential backoff with jitter) happen only where a retry
is safe or the server asks for it: connection errors (the request never reached the tool) and 5xx answers
(including 503 "busy", honouring Retry-After). A read timeout is never retried: the tool may be running.
Every failure comes back as a `ToolResult(ok=False)` whose content tells the model what happened.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import httpx

from agentrl.tools.core import ToolResult

_RETRYABLE_EXC = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.PoolTimeout)


class ToolServerError(RuntimeError):
    """A management call (list tools, sessions, health) failed after retries."""


class ToolClient:
    """Talks to one tool server. Safe to share between many concurrent episodes."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.05,
        max_connections: int = 256,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=min(5.0, timeout_s)),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            transport=transport,
        )

    async def _request(self, method: str, path: str, timeout_s: float | None = None, **kw: Any) -> httpx.Response:
        """Send, retrying connection errors and 5xx; returns the last response or raises the last error."""
        timeout = httpx.Timeout(timeout_s, connect=min(5.0, timeout_s)) if timeout_s else httpx.USE_CLIENT_DEFAULT
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                resp = await self._http.request(method, path, timeout=timeout, **kw)
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
            resp = await self._request("POST", f"/tools/{name}/call", timeout_s=timeout_s, json=body)
        except httpx.TimeoutException:
            return ToolResult.failure(f"{name} timed out waiting for the tool server", time.perf_counter() - start)
        except httpx.HTTPError as err:
            msg = f"tool server unreachable for {name}: {type(err).__name__}: {err}"
            return ToolResult.failure(msg, time.perf_counter() - start)
        elapsed = time.perf_counter() - start
        if resp.status_code == 200:
            try:
                return ToolResult.model_validate(resp.json())
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

    async def _checked(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            resp = await self._request(method, path, **kw)
        except httpx.HTTPError as err:
            raise ToolServerError(f"{method} {self.base_url}{path}: {type(err).__name__}: {err}") from err
        if resp.status_code >= 400:
            raise ToolServerError(f"{method} {self.base_url}{path}: {_describe_error('', resp)}")
        return resp

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> ToolClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _describe_error(name: str, resp: httpx.Response) -> str:
    """Turn an HTTP error answer into one line the model (or a person) can act on."""
    try:
        detail = resp.json().get("detail", resp.text)
    except ValueError:
        detail = resp.text
    if resp.status_code == 422 and isinstance(detail, list):  # FastAPI validation: name the fields
        parts = []
        for e in detail:
            loc = [str(p) for p in e.get("loc", []) if p not in ("body", "arguments")]
            parts.append(f"{'.'.join(loc) or 'arguments'}: {e.get('msg', '')}")
        return f"invalid arguments for {name}: " + "; ".join(parts)
    prefix = f"{name}: " if name else ""
    return f"{prefix}tool server answered {resp.status_code}: {str(detail)[:300]}"
