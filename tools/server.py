"""FastAPI app behind `agentrl serve-tools`: list, call, sessions, health; auth, limits, JSON access logs.

Each tool gets its own typed route (`POST /tools/{name}/call`) whose body model is the tool's argument model,
so FastAPI's validation answers 422 naming the bad field and the OpenAPI document describes every tool exactly
(which is also what the fuzz test drives). Auth, the body-size limit and the access log are one pure-ASGI
middleware: Starlette's BaseHTTPMiddleware would cost a task per request at high call rates.

Tool calls take a fast path in that middleware: a `POST /tools/{name}/call` with a JSON body that the call
model validates (`model_validate_json`, one pass in pydantic-core) runs the tool right there, under the same
limiter and timeout, and skips Starlette's routing, FastAPI's request parsing and dependency solving (about
half the server's CPU per call). Anything else (invalid JSON, a validation error, another content type)
is handed on, with the body already read, to the FastAPI route, which answers exactly as before (422 naming
the field, 400, ...).
"""

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from agentrl.fast_path import FastHandler, serve_fast, takes_json
from agentrl.tools.core import SessionStore, Tool, ToolResult
from agentrl.tools.mcp_server import add_mcp

access_log = logging.getLogger("agentrl.tools.access")
OPEN_PATHS = frozenset({"/health"})  # liveness probes need no token; they reveal nothing but "ok"
# Session ids travel in JSON bodies, never in paths: env managers use ids like "train/sokoban/3/0".
SessionId = Annotated[str, Field(min_length=1, max_length=256)]
# A tool call validated ahead of FastAPI: body -> the response, or None to hand the request to the route.
FastCall = FastHandler  # one per tool's call route: (body, headers) -> its answer, or None to hand on


class SessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    session_id: SessionId


@dataclass
class ServerLimits:
    """Why each limit exists: a tool server is shared by many env managers and must degrade politely."""

    max_concurrency: int = 256  # tool calls running at once
    max_queue: int = 1024  # calls waiting for a slot; beyond this, 503 at once
    queue_timeout_s: float = 10.0  # a call waiting longer than this gets 503 (client retries with backoff)
    max_body_bytes: int = 1 << 20  # request bodies above this get 413
    max_sessions: int = 10_000  # open episode sessions; beyond this, 429
    default_timeout_s: float = 30.0  # per-call wall time for tools that set none


class Detail(BaseModel):
    detail: Any


ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": Detail, "description": "body is not parseable (e.g. not UTF-8 JSON)"},
    401: {"model": Detail, "description": "missing or wrong bearer token"},
    413: {"model": Detail, "description": "request body too large"},
    429: {"model": Detail, "description": "too many open sessions"},
    503: {"model": Detail, "description": "server busy; retry after Retry-After seconds"},
}


class _Limiter:
    """Concurrency slots plus a bounded wait queue, so overload turns into a clear 503, never a pile-up."""

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self.sem = asyncio.Semaphore(limits.max_concurrency)
        self.pending = 0  # running + waiting

    def busy(self) -> JSONResponse:
        lim = self.limits
        msg = f"server busy: {lim.max_concurrency} calls running and up to {lim.max_queue} queued; retry later"
        return JSONResponse({"detail": msg}, status_code=503, headers={"Retry-After": "1"})

    async def run(self, call: Callable[[], Awaitable[Response]]) -> Response:
        """`call()` in a concurrency slot; 503 at once when the queue is full, or when the wait for a slot times
        out."""
        if self.pending >= self.limits.max_concurrency + self.limits.max_queue:
            return self.busy()
        self.pending += 1
        try:
            if self.sem.locked():
                try:
                    await asyncio.wait_for(self.sem.acquire(), self.limits.queue_timeout_s)
                except TimeoutError:
                    return self.busy()
            else:
                await self.sem.acquire()
            try:
                return await call()
            finally:
                self.sem.release()
        finally:
            self.pending -= 1


def _call_model(t: Tool) -> type[BaseModel]:
    try:
        t.args_model()
        arguments: Any = (t.args_model, Field(default_factory=t.args_model))
    except ValueError:  # pydantic ValidationError: the tool has required arguments
        arguments = (t.args_model, ...)
    return create_model(
        f"{t.name}_call",
        __config__=ConfigDict(extra="forbid"),
        arguments=arguments,
        session_id=(SessionId | None, None),
    )


def create_app(tools: list[Tool], token: str | None = None, limits: ServerLimits | None = None) -> FastAPI:
    """Build the tool server app. With `token`, all paths but /health need `Authorization: Bearer <token>`."""
    limits = limits or ServerLimits()
    if len({t.name for t in tools}) != len(tools):
        raise ValueError("duplicate tool names")
    sessions = SessionStore(limits.max_sessions)
    limiter = _Limiter(limits)
    app = _new_app(sessions)
    _add_info_routes(app, tools, sessions, limiter)
    fast_calls = _add_tool_routes(app, tools, sessions, limiter)
    _add_session_routes(app, sessions)
    app.state.lifespans = [add_mcp(app, tools, sessions, limiter, guarded=token is not None)]
    _add_guard(app, token, limits.max_body_bytes, fast_calls)
    return app


def _new_app(sessions: SessionStore) -> FastAPI:
    """The bare app; its shutdown closes every open session (running their cleanups)."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            for enter in getattr(_app.state, "lifespans", []):  # the MCP session manager's
                await stack.enter_async_context(enter())
            yield
        await sessions.close_all()

    app = FastAPI(
        title="agentrl tool server",
        version="1",
        description="Tools for agentic RL episodes.",
        lifespan=lifespan,
    )
    app.state.sessions = sessions
    return app


def _add_info_routes(app: FastAPI, tools: list[Tool], sessions: SessionStore, limiter: _Limiter) -> None:
    """GET /health (open to all, for liveness probes) and GET /tools (the schemas, built once)."""

    @app.get("/health", openapi_extra={"security": []})
    async def health() -> dict[str, Any]:
        """Liveness plus load: calls pending and sessions open."""
        return {"status": "ok", "tools": len(tools), "pending": limiter.pending, "sessions": len(sessions)}

    schemas = [t.schema() for t in tools]

    @app.get("/tools", responses={401: ERRORS[401]})
    async def list_tools() -> dict[str, list[dict[str, Any]]]:
        """OpenAI function schemas of every tool served here."""
        return {"tools": schemas}


def _add_tool_routes(app: FastAPI, tools: list[Tool], sessions: SessionStore, limiter: _Limiter) -> dict[str, FastCall]:
    """One typed call route per tool, then a 404 naming the known tools for any other name (it must come last,
    or it would shadow the typed routes). Returns the fast path of each call route, by path."""
    fast_calls = {
        f"/tools/{t.name}/call": _add_call_route(
            app, t, sessions, limiter, t.timeout_s or limiter.limits.default_timeout_s
        )
        for t in tools
    }
    known = ", ".join(t.name for t in tools) or "none"

    @app.post("/tools/{name}/call", responses={404: {"model": Detail}, **ERRORS}, include_in_schema=False)
    async def unknown_tool(name: str) -> JSONResponse:
        return JSONResponse({"detail": f"unknown tool {name!r}; available tools: {known}"}, status_code=404)

    return fast_calls


def _add_session_routes(app: FastAPI, sessions: SessionStore) -> None:
    """POST /sessions/open and /sessions/close: per-episode tool state."""

    @app.post("/sessions/open", responses={k: ERRORS[k] for k in (400, 401, 413, 429)})
    async def open_session(req: SessionRequest) -> dict[str, Any]:
        """Open per-episode state (calls with an unknown session_id open one implicitly)."""
        try:
            sessions.open(req.session_id)
        except OverflowError as err:
            return JSONResponse({"detail": str(err)}, status_code=429)  # type: ignore[return-value]
        return {"session_id": req.session_id, "open": True}

    @app.post("/sessions/close", responses={k: ERRORS[k] for k in (400, 401, 413)})
    async def close_session(req: SessionRequest) -> dict[str, Any]:
        """Close an episode's state and run its cleanups; closing an unknown session is not an error."""
        return {"session_id": req.session_id, "closed": await sessions.close(req.session_id)}


def _add_guard(app: FastAPI, token: str | None, max_body_bytes: int, fast_calls: dict[str, FastCall]) -> None:
    """Auth, the body-size limit and the tool-call fast path (one pure-ASGI middleware), and the bearer scheme
    in OpenAPI when a token is set."""
    _document_auth(app, token is not None)
    app.add_middleware(GuardMiddleware, token=token, max_body_bytes=max_body_bytes, fast_calls=fast_calls)


def _add_call_route(app: FastAPI, t: Tool, sessions: SessionStore, limiter: _Limiter, timeout_s: float) -> FastCall:
    """The typed FastAPI route (OpenAPI, error answers), and returns its fast path for valid calls."""
    request_model = _call_model(t)
    validate_json = request_model.model_validate_json

    async def fast_call(body: bytes, headers: dict[bytes, bytes]) -> Response | None:
        try:
            req = validate_json(body)
        except ValidationError:
            return None  # the route answers: 422 naming the field, or json_invalid
        return await limiter.run(lambda: _run_tool(t, req, sessions, timeout_s))

    async def call(req: request_model) -> ToolResult:  # type: ignore[valid-type]
        return await limiter.run(lambda: _run_tool(t, req, sessions, timeout_s))  # type: ignore[return-value]

    call.__name__ = f"call_{t.name}"
    call.__doc__ = t.description
    app.post(
        f"/tools/{t.name}/call",
        response_model=ToolResult,
        responses=ERRORS,
        summary=f"call {t.name}",
        description=t.description,
        operation_id=f"call_{t.name}",
    )(call)
    return fast_call


async def _run_tool(t: Tool, req: Any, sessions: SessionStore, timeout_s: float) -> Response:
    """One call in its session; 429 when opening that session would pass the session limit."""
    try:
        session = sessions.open(req.session_id) if req.session_id else None
        result = await t.run(req.arguments, session, timeout_s)
        # already a validated model: serialise once, skipping FastAPI's re-validation of response_model
        return Response(_dump_result(result), media_type="application/json")
    except OverflowError as err:
        return JSONResponse({"detail": str(err)}, status_code=429)


_dump_result = ToolResult.__pydantic_serializer__.to_json  # bytes, as model_dump_json() before its decode


def _document_auth(app: FastAPI, enabled: bool) -> None:
    """Declare the bearer scheme in OpenAPI so clients and fuzzers know to send the token."""
    if not enabled:
        return

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            schema.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            schema["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


class GuardMiddleware:
    """Pure ASGI: bearer auth, body-size limit (Content-Length and streamed), the tool-call fast path, one JSON
    access-log line per request."""

    def __init__(
        self, app: Any, token: str | None, max_body_bytes: int, fast_calls: dict[str, FastCall] | None = None
    ) -> None:
        self.app = app
        self.token = token.encode() if token else None
        self.max_body = max_body_bytes
        self.fast_calls = fast_calls or {}
        self.log_lines: list[str] = []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [0]
        headers = dict(scope.get("headers") or ())

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.token is not None and scope["path"] not in OPEN_PATHS and not self._authorized(headers):
                await _reject(send_wrapper, 401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})
            elif _content_length(headers) > self.max_body:
                await _reject(send_wrapper, 413, f"request body over {self.max_body} bytes")
            elif (fast := self._fast_call(scope, headers)) is not None:
                await serve_fast(fast, self.app, scope, receive, send_wrapper, self.max_body, self._too_large)
            else:
                await self.app(scope, self._limited(receive), send_wrapper)
        finally:
            if access_log.isEnabledFor(logging.INFO):
                client = scope.get("client") or ("", 0)
                ms = round((time.perf_counter() - start) * 1000, 3)
                # json.dumps({"ts", "client", "method", "path", "status", "ms"}), without its per-call set-up
                self.log_lines.append(
                    f'{{"ts": {round(time.time(), 3)!r}, "client": {_json_str(client[0])}, '
                    f'"method": {_json_str(scope["method"])}, "path": {_json_str(scope["path"])}, '
                    f'"status": {status[0]}, "ms": {ms!r}}}'
                )
                if len(self.log_lines) == 1:
                    asyncio.get_running_loop().call_soon(self._flush_log)

    def _flush_log(self) -> None:
        """The access-log lines of the requests that finished in one event-loop turn, as one record: still one
        JSON object per line, but one logging call and one write for the lot (a record per request was about a
        third of the server's CPU per call at thousands of calls/s)."""
        lines, self.log_lines = self.log_lines, []
        if lines:
            access_log.info("\n".join(lines))

    def _fast_call(self, scope: dict, headers: dict[bytes, bytes]) -> FastCall | None:
        """The fast path for a tool call with a JSON body (as FastAPI reads one), else None."""
        if scope["method"] != "POST" or scope.get("root_path"):
            return None
        fast = self.fast_calls.get(scope["path"])
        if fast is None:
            return None
        return fast if takes_json(headers) else None

    async def _too_large(self, send: Any) -> None:
        await _reject(send, 413, f"request body over {self.max_body} bytes")

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        auth = headers.get(b"authorization", b"")
        scheme, _, given = auth.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.token or b"")

    def _limited(self, receive: Any) -> Any:
        seen = [0]

        async def wrapped() -> dict:
            message = await receive()
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > self.max_body:  # chunked bodies carry no Content-Length; FastAPI turns this into 413
                    raise HTTPException(413, f"request body over {self.max_body} bytes")
            return message

        return wrapped


_json_str = functools.lru_cache(maxsize=4096)(json.dumps)  # a few distinct paths, clients and methods


def _content_length(headers: dict[bytes, bytes]) -> int:
    try:
        return int(headers.get(b"content-length", b"0"))
    except ValueError:
        return 0


async def _reject(send: Any, status: int, detail: str, extra: dict[str, str] | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})
