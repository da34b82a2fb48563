"""Toolbox: the one object an env manager talks to. Local (`python:`) and remote (`url:`) tools look the same.

`build_toolbox(cfg.tools, env_spec.tools)` resolves the named tool sets; `schemas()` goes into the chat
template's `tools=`; `await call(name, arguments, session_id)` always returns a `ToolResult` (failures,
timeouts, unknown tools and bad arguments become `ok=False` with a message for the model).
`open_session` / `close_session` bracket an episode so stateful tools start fresh each time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx
from pydantic import ValidationError

from agentrl.config.schema import ToolsConfig
from agentrl.plugins import import_object
from agentrl.tools.client import ToolClient, ToolServerError, token_from_env
from agentrl.tools.core import SessionStore, Tool, ToolResult, format_validation_error, to_content

log = logging.getLogger(__name__)
REMOTE_GRACE_S = 1.0  # extra client-side wait so a server can report its own timeout before we give up


def load_python_tool(path: str, name: str | None = None, timeout_s: float | None = None) -> Tool:
    """`module:function` (a plain function or a `Tool`) -> Tool, named `name` when given."""
    try:
        obj = import_object(path)
    except ValueError:
        raise ValueError(f"python tool {path!r} must look like module:function") from None
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot load tool {path!r}: {err}") from None
    if isinstance(obj, Tool):
        tool = Tool(obj.fn, name=name or obj.name, description=obj.description, timeout_s=timeout_s or obj.timeout_s)
        tool.check = obj.check
        return tool
    if not callable(obj):
        raise ValueError(f"tool {path!r} is not callable")
    return Tool(obj, name=name, timeout_s=timeout_s)


class Toolbox:
    """Named tools (local `Tool`s and remote ones behind `ToolClient`s) with per-episode sessions."""

    def __init__(self, max_sessions: int = 100_000) -> None:
        self.local: dict[str, Tool] = {}
        self.remote: dict[str, tuple[ToolClient, dict[str, Any], float]] = {}  # name -> (client, schema, timeout)
        self.sessions = SessionStore(max_sessions)
        self._clients: dict[tuple[str, str | None], ToolClient] = {}
        self._remote_used: dict[str, set[ToolClient]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.local or name in self.remote

    @property
    def names(self) -> list[str]:
        return [*self.local, *self.remote]

    def add(self, t: Tool) -> None:
        if t.name in self:
            raise ValueError(f"duplicate tool name {t.name!r}")
        self.local[t.name] = t

    def client(self, url: str, token: str | None, timeout_s: float) -> ToolClient:
        """One pooled client per (server, token), shared by all tools that live there."""
        key = (url.rstrip("/"), token)
        if key not in self._clients:
            self._clients[key] = ToolClient(url, token=token, timeout_s=timeout_s + REMOTE_GRACE_S)
        return self._clients[key]

    def add_remote(self, name: str, client: ToolClient, schema: dict[str, Any], timeout_s: float) -> None:
        if name in self:
            raise ValueError(f"duplicate tool name {name!r}")
        self.remote[name] = (client, schema, timeout_s)

    def schemas(self) -> list[dict[str, Any]]:
        """OpenAI function schemas for every tool, local first, for `apply_chat_template(tools=...)`."""
        return [t.schema() for t in self.local.values()] + [s for _, s, _ in self.remote.values()]

    async def call(self, name: str, arguments: dict[str, Any], session_id: str | None = None) -> ToolResult:
        """Run one tool call. Never raises for tool-side problems; the result's content explains them."""
        start = time.perf_counter()
        if not isinstance(arguments, dict):
            return ToolResult.failure(f"arguments of {name} must be a JSON object")
        if name in self.local:
            t = self.local[name]
            try:
                args = t.validate(arguments)
            except ValidationError as err:
                return ToolResult.failure(format_validation_error(name, err), time.perf_counter() - start)
            try:
                session = self.sessions.open(session_id) if session_id is not None else None
            except OverflowError as err:
                return ToolResult.failure(str(err))
            return await t.run(args, session)
        if name in self.remote:
            client, _, timeout_s = self.remote[name]
            if session_id is not None:
                self._remote_used.setdefault(session_id, set()).add(client)
            result = await client.call(name, arguments, session_id, timeout_s=timeout_s + REMOTE_GRACE_S)
            result.content = to_content(result.content)
            return result
        known = ", ".join(self.names) or "none"
        return ToolResult.failure(f"unknown tool {name!r}; available tools: {known}")

    async def open_session(self, session_id: str) -> None:
        """Start an episode's state. Remote servers open theirs lazily, on the episode's first call."""
        self.sessions.open(session_id)

    async def close_session(self, session_id: str) -> None:
        """End an episode: local cleanups run, and remote servers it called drop their state too."""
        await self.sessions.close(session_id)
        for client in self._remote_used.pop(session_id, ()):
            try:
                await client.close_session(session_id)
            except ToolServerError as err:  # the episode is over either way; the server's cap bounds leaks
                log.warning("closing remote session %s: %s", session_id, err)

    async def aclose(self) -> None:
        for sid in list(self._remote_used):
            await self.close_session(sid)
        await self.sessions.close_all()
        await asyncio.gather(*(c.aclose() for c in self._clients.values()))
        self._clients.clear()


def _fetch_schemas(url: str, token: str | None, attempts: int = 5) -> dict[str, dict[str, Any]]:
    """GET {url}/tools once per server at build time (retrying connection errors while a server starts)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    for attempt in range(attempts):
        try:
            resp = httpx.get(f"{url.rstrip('/')}/tools", headers=headers, timeout=10.0)
            break
        except (httpx.ConnectError, httpx.ConnectTimeout) as err:
            if attempt == attempts - 1:
                raise ToolServerError(f"tool server {url} unreachable: {err}") from err
            time.sleep(0.2 * 2**attempt)
    if resp.status_code != 200:
        raise ToolServerError(f"tool server {url}: GET /tools answered {resp.status_code}: {resp.text[:200]}")
    return {s["function"]["name"]: s for s in resp.json()["tools"]}


def build_toolbox(tools_config: ToolsConfig, set_names: list[str]) -> Toolbox:
    """Resolve the named tool sets of a config into a Toolbox (remote schemas are fetched once, here)."""
    box = Toolbox()
    fetched: dict[tuple[str, str | None], dict[str, dict[str, Any]]] = {}
    for set_name in set_names:
        if set_name not in tools_config.sets:
            known = ", ".join(sorted(tools_config.sets)) or "none"
            raise ValueError(f"unknown tool set {set_name!r} (tools.sets has: {known})")
        for name, spec in tools_config.sets[set_name].items():
            if name in box:
                raise ValueError(f"tool {name!r} appears in more than one of the sets {set_names}")
            if spec.python is not None:
                box.add(load_python_tool(spec.python, name=name, timeout_s=spec.timeout_s))
                continue
            token = token_from_env(spec.token_env, "tool server token")
            key = (spec.url.rstrip("/"), token)
            if key not in fetched:
                fetched[key] = _fetch_schemas(spec.url, token)
            if name not in fetched[key]:
                raise ValueError(f"tool {name!r}: server {spec.url} does not serve it (has {sorted(fetched[key])})")
            box.add_remote(name, box.client(spec.url, token, spec.timeout_s), fetched[key][name], spec.timeout_s)
    return box
