"""The FastAPI app of one `agentrl serve-envs` worker: OpenEnv's `/ws` sessions plus its HTTP routes.

One WebSocket is one session with its own env instance (OpenEnv's model), so per-session concurrency is one
call at a time by construction. The tool server's rules apply: a bearer token on everything but `/health`
(its `GuardMiddleware` for HTTP, the same check at the WebSocket handshake), a body/message size limit, a cap
on open sessions (503 at the handshake, with Retry-After), a cap on env calls running at once (a thread pool),
and idle sessions expire. Bad input is a 4xx or an error frame, never a 500 or a dropped server.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import random
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, HTTPException, WebSocket
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.websockets import WebSocketDisconnect

from agentrl.envserve import protocol as P
from agentrl.tools.server import GuardMiddleware


@dataclass
class EnvServerLimits:
    """Why each limit exists: one env server is shared by many env managers and must degrade politely."""

    max_sessions: int = 512  # open WebSocket sessions per worker; beyond this, 503 at the handshake
    max_concurrency: int = 32  # env calls running at once per worker (threads)
    max_body_bytes: int = 1 << 20  # HTTP bodies and WebSocket messages above this: 413 / MESSAGE_TOO_LARGE
    idle_timeout_s: float = 300.0  # a session silent this long is closed (SESSION_EXPIRED)
    call_timeout_s: float = 60.0  # one env call (reset/step) longer than this is an EXECUTION_ERROR


@dataclass
class _Session:
    env_id: str
    env: Any
    last_used: float = field(default_factory=time.monotonic)
    steps: int = 0


class ResetBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seed: int | None = Field(None, ge=0, lt=2**63, strict=True)
    episode_id: str | None = Field(None, max_length=255)
    env_id: str | None = None


class StepBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    action: dict[str, Any]
    seed: int | None = Field(
        None, ge=0, lt=2**63, strict=True, description="stateless step: reset with this seed, then step"
    )
    timeout_s: float | None = Field(None, gt=0)
    request_id: str | None = Field(None, max_length=255)
    env_id: str | None = None


def rss_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 where unavailable)."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class EnvService:
    """Sessions and env calls of one worker; `retire()` ends every session with a clear error frame."""

    def __init__(self, env_ids: list[str], limits: EnvServerLimits, env_kwargs: dict[str, dict] | None = None):
        if not env_ids:
            raise ValueError("serve at least one env id")
        self.env_ids = list(env_ids)
        self.env_kwargs = env_kwargs or {}
        self.limits = limits
        self.pool = ThreadPoolExecutor(limits.max_concurrency, thread_name_prefix="envserve")
        self.sessions: dict[int, _Session] = {}
        self.sockets: dict[int, WebSocket] = {}
        self.retiring: str | None = None

    def make(self, env_id: str) -> Any:
        from agentrl.envs import make_env

        return make_env(env_id, **self.env_kwargs.get(env_id, {}))

    async def call(self, fn: Callable, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await asyncio.wait_for(loop.run_in_executor(self.pool, fn, *args), self.limits.call_timeout_s)

    def resolve(self, env_id: str | None) -> str:
        if env_id is None:
            return self.env_ids[0]
        if env_id not in self.env_ids:
            raise HTTPException(404, f"env {env_id!r} is not served here; served: {', '.join(self.env_ids)}")
        return env_id

    async def retire(self, reason: str) -> None:
        """Stop taking sessions and end the open ones with a WORKER_RETIRED frame (clients open a new one)."""
        self.retiring = reason
        for sid, ws in list(self.sockets.items()):
            try:
                text = P.error(f"env server worker retired: {reason}; open a new session", P.WORKER_RETIRED)
                await ws.send_text(text)
                await ws.close(code=1012, reason="worker retired")
            except Exception:
                pass
            self.sockets.pop(sid, None)

    def health(self) -> dict[str, Any]:
        return {
            "status": "unhealthy" if self.retiring else "healthy",
            "envs": self.env_ids,
            "sessions": len(self.sessions),
            "max_sessions": self.limits.max_sessions,
            "pid": os.getpid(),
            "rss_bytes": rss_bytes(),
            "openenv_protocol": P.OPENENV_VERSION,
        }


def reset_data(env: Any, seed: int | None) -> dict[str, Any]:
    obs, info = env.reset(seed=seed)
    return P.observation(obs, None, False, False, info, env.max_steps, system_prompt=env.system_prompt())


def step_data(env: Any, action: dict[str, Any]) -> dict[str, Any]:
    text = action.get(P.ACTION_FIELD)
    if not isinstance(text, str) or set(action) - {P.ACTION_FIELD, "metadata"}:
        raise ValueError(f'a text action is {{"{P.ACTION_FIELD}": "<model output>"}}, got keys {sorted(action)}')
    obs, reward, terminated, truncated, info = env.step(text)
    return P.observation(obs, float(reward), bool(terminated), bool(truncated), info, env.max_steps)


def create_app(
    env_ids: list[str],
    token: str | None = None,
    limits: EnvServerLimits | None = None,
    env_kwargs: dict[str, dict] | None = None,
) -> FastAPI:
    """The app of one worker. With `token`, every path but /health needs `Authorization: Bearer <token>`."""
    limits = limits or EnvServerLimits()
    service = EnvService(env_ids, limits, env_kwargs)
    for env_id in service.env_ids:  # unknown ids and bad kwargs fail now, not at the first session
        service.make(env_id).close()

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        reaper = asyncio.create_task(_reap_idle(service))
        yield
        reaper.cancel()
        await service.retire("server shutting down")
        service.pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="agentrl env server (OpenEnv protocol)", lifespan=lifespan)
    app.state.service = service
    _add_http_routes(app, service)
    _add_ws_route(app, service, token)
    app.add_middleware(GuardMiddleware, token=token, max_body_bytes=limits.max_body_bytes)
    return app


async def _reap_idle(service: EnvService) -> None:
    """Idle sessions whose socket waits in receive are closed by their own handler; this catches the rest."""
    while True:
        await asyncio.sleep(min(5.0, service.limits.idle_timeout_s / 2))
        now = time.monotonic()
        for sid, s in list(service.sessions.items()):
            ws = service.sockets.get(sid)
            if ws is not None and now - s.last_used > service.limits.idle_timeout_s * 2:
                try:
                    await ws.close(code=4408, reason="session expired")
                except Exception:
                    pass


def _add_http_routes(app: FastAPI, service: EnvService) -> None:
    @app.get("/health")
    async def health() -> dict[str, Any]:
        return service.health()

    @app.get("/metadata")
    async def metadata(env_id: str | None = None) -> dict[str, Any]:
        env_id = service.resolve(env_id)
        return {"name": env_id, "description": f"agentrl text env {env_id} (text in, text out)", "version": None}

    @app.get("/schema")
    async def schema() -> dict[str, Any]:
        return {"action": P.action_schema(), "observation": P.observation_schema(), "state": {"type": "object"}}

    @app.post("/reset")
    async def reset(body: ResetBody) -> dict[str, Any]:
        """Stateless, as OpenEnv's simulation mode: a fresh env, reset, closed."""
        env_id = service.resolve(body.env_id)
        return await _http_call(service, _once, service, env_id, lambda env: reset_data(env, body.seed))

    @app.post("/step")
    async def step(body: StepBody) -> dict[str, Any]:
        """Stateless: a fresh env reset with `seed`, one step, closed (stateful episodes use /ws)."""
        env_id = service.resolve(body.env_id)

        def run(env: Any) -> dict[str, Any]:
            env.reset(seed=body.seed)
            return step_data(env, body.action)

        return await _http_call(service, _once, service, env_id, run)


async def _http_call(service: EnvService, fn: Callable, *args: Any) -> Any:
    """An env call for an HTTP route: bad values are 422, a call over the time limit 503 (retry)."""
    try:
        return await service.call(fn, *args)
    except (ValueError, TypeError) as err:
        raise HTTPException(422, str(err)) from None
    except TimeoutError:
        msg = f"env call took over {service.limits.call_timeout_s:g}s; retry later"
        raise HTTPException(503, msg, headers={"Retry-After": "1"}) from None


def _once(service: EnvService, env_id: str, fn: Callable[[Any], dict]) -> dict:
    env = service.make(env_id)
    try:
        return fn(env)
    finally:
        env.close()


def _authorized(ws: WebSocket, token: str | None) -> bool:
    if token is None:
        return True
    scheme, _, given = ws.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


async def _deny(ws: WebSocket, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
    """Refuse the handshake with an HTTP status (servers without the denial extension see a 403)."""
    try:
        await ws.send_denial_response(JSONResponse({"detail": detail}, status_code=status, headers=headers))
    except RuntimeError:
        await ws.close(code=1008, reason=detail[:120])


def _add_ws_route(app: FastAPI, service: EnvService, token: str | None) -> None:
    @app.websocket("/ws")
    async def session(ws: WebSocket) -> None:
        if not _authorized(ws, token):
            await _deny(ws, 401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})
            return
        try:
            env_id = service.resolve(ws.query_params.get("env_id"))
        except HTTPException as err:
            await _deny(ws, err.status_code, str(err.detail))
            return
        if service.retiring:
            await _deny(ws, 503, f"worker retiring ({service.retiring}); retry", {"Retry-After": "1"})
            return
        if len(service.sessions) >= service.limits.max_sessions:
            msg = f"too many open sessions on this worker (limit {service.limits.max_sessions}); retry later"
            await _deny(ws, 503, msg, {"Retry-After": "1"})
            return
        sid = id(ws)
        service.sessions[sid] = _Session(env_id, None)  # counted before the (slow) env build
        try:
            await ws.accept()
            service.sockets[sid] = ws
            service.sessions[sid].env = await service.call(service.make, env_id)
            await _serve_session(ws, service, service.sessions[sid])
        except (WebSocketDisconnect, RuntimeError):
            pass  # the client went away or the worker retired the socket
        finally:
            s = service.sessions.pop(sid, None)
            service.sockets.pop(sid, None)
            if s is not None and s.env is not None:
                s.env.close()


async def _serve_session(ws: WebSocket, service: EnvService, s: _Session) -> None:
    limits = service.limits
    rng_seed = 0
    while True:
        try:
            msg = await asyncio.wait_for(ws.receive(), limits.idle_timeout_s)
        except TimeoutError:
            idle = f"session idle for over {limits.idle_timeout_s:g}s; closed"
            await ws.send_text(P.error(idle, P.SESSION_EXPIRED))
            await ws.close(code=4408, reason="session expired")
            return
        if msg["type"] == "websocket.disconnect":
            return
        raw = msg.get("text") if msg.get("text") is not None else (msg.get("bytes") or b"").decode("utf-8", "replace")
        if len(raw) > limits.max_body_bytes:
            too_big = f"message over {limits.max_body_bytes} bytes (413); session closed"
            await ws.send_text(P.error(too_big, P.MESSAGE_TOO_LARGE, status=413))
            await ws.close(code=1009, reason="message too large")
            return
        s.last_used = time.monotonic()
        try:
            request = json.loads(raw)
            if not isinstance(request, dict):
                raise json.JSONDecodeError("expected a JSON object", raw, 0)
        except json.JSONDecodeError as err:
            await ws.send_text(P.error(f"Invalid JSON: {err}", P.INVALID_JSON))
            continue
        kind, data = request.get("type"), request.get("data") or {}
        if kind == "close":
            await ws.close()
            return
        try:
            if not isinstance(data, dict):
                raise ValueError("data must be a JSON object")
            reply = await _handle(service, s, kind, data, rng_seed)
        except TimeoutError:
            reply = P.error(f"env call took over {limits.call_timeout_s:g}s", P.EXECUTION_ERROR)
        except (ValueError, TypeError) as err:
            reply = P.error(str(err), P.VALIDATION_ERROR)
        except Exception as err:  # the env's own bug: this call fails, the session and server stay
            reply = P.error(f"{type(err).__name__}: {err}", P.EXECUTION_ERROR)
        s.last_used = time.monotonic()
        await ws.send_text(reply)


async def _handle(service: EnvService, s: _Session, kind: Any, data: dict, rng_seed: int) -> str:
    env = s.env
    if kind == "reset":
        seed = data.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")
        s.steps = 0
        return P.message("observation", await service.call(reset_data, env, seed))
    if kind == "step":
        s.steps += 1
        return P.message("observation", await service.call(step_data, env, data))
    if kind == "state":
        return P.message("state", {"episode_id": None, "step_count": s.steps, "env_id": s.env_id})
    if kind == P.EXPERT:
        return P.message("action", {"action": await service.call(env.expert_action)})
    if kind == P.RANDOM:
        seed = int(data.get("seed", rng_seed))
        return P.message("action", {"action": await service.call(env.random_action, random.Random(seed))})
    return P.error(f"Unknown message type: {kind}", P.UNKNOWN_TYPE)
