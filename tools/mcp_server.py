"""The tool server's tools over the Model Context Protocol: streamable HTTP at `/mcp`, through the official `mcp` SDK.

Agent frameworks reach tools over MCP; this serves the same tools, behind the same guard (bearer token, body
limit, JSON access log), the same concurrency limiter and per-call timeouts, and the same per-episode sessions as the
REST routes. A call's session is the `Agentrl-Session` header when the client sends one (an episode's id: the REST
routes' `session_id`), else the MCP session id of a handshake-era client; `POST /sessions/close` ends either.
A failing, timed-out or unknown tool is a tool result with `isError`, as MCP has it, never a protocol error.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from pydantic import ValidationError

from agentrl.tools.core import SessionStore, Tool, format_validation_error

SESSION_HEADER = "agentrl-session"


def add_mcp(app: Any, tools: list[Tool], sessions: SessionStore, limiter: Any, guarded: bool) -> Any:
    """Add the `/mcp` route to `app`; returns the lifespan its session manager needs (the app's lifespan enters
    it). `guarded`: a bearer token protects the server, so the SDK's DNS-rebinding check (meant for unguarded
    loopback servers) is left off and any Host may reach it."""
    import mcp_types as types
    from mcp.server.lowlevel import Server
    from mcp.server.transport_security import TransportSecuritySettings

    by_name = {t.name: t for t in tools}
    listing = types.ListToolsResult(
        tools=[
            types.Tool(name=t.name, description=t.description, input_schema=t.schema()["function"]["parameters"])
            for t in tools
        ]
    )

    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        return listing

    async def call_tool(ctx: Any, params: Any) -> types.CallToolResult:
        return await _call(by_name, sessions, limiter, ctx, params)

    server = Server("agentrl-tools", on_list_tools=list_tools, on_call_tool=call_tool)
    security = TransportSecuritySettings(enable_dns_rebinding_protection=False) if guarded else None
    mcp_app = server.streamable_http_app(streamable_http_path="/mcp", transport_security=security)
    for route in mcp_app.routes:
        app.router.routes.append(route)

    @asynccontextmanager
    async def lifespan() -> AsyncIterator[None]:
        async with server.session_manager.run():
            yield

    return lifespan


def _error(text: str) -> Any:
    import mcp_types as types

    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=True)


async def _call(by_name: dict[str, Tool], sessions: SessionStore, limiter: Any, ctx: Any, params: Any) -> Any:
    """One MCP tools/call: validated like the REST route, in the episode's session (the `Agentrl-Session` header,
    else MCP's own session id), under the server's limiter and the tool's timeout."""
    import mcp_types as types

    t = by_name.get(params.name)
    if t is None:
        return _error(f"unknown tool {params.name!r}; available tools: {', '.join(by_name) or 'none'}")
    try:
        args = t.validate(params.arguments or {})
    except ValidationError as err:
        return _error(format_validation_error(t.name, err))
    headers = getattr(ctx.request, "headers", None) or {}
    session_id = headers.get(SESSION_HEADER) or headers.get("mcp-session-id")
    try:
        session = sessions.open(session_id) if session_id else None
    except OverflowError as err:
        return _error(str(err))
    timeout_s = t.timeout_s or limiter.limits.default_timeout_s
    result: Any = None

    async def run() -> Any:
        nonlocal result
        result = await t.run(args, session, timeout_s)
        return None

    answer = await limiter.run(run)
    if result is None:  # the limiter answered instead: the server is busy
        return _error(answer.body.decode() if answer is not None else "server busy")
    text = result.content if result.ok else f"error: {result.error or result.content}"
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=not result.ok)
