"""The gateway: an OpenAI-compatible chat-completions API in front of the rollout engines, one key per episode.

It runs inside an env manager, on the manager's event loop (uvicorn serving a socket bound here), so a call reaches
the episode's engine the way a native turn does (`EngineClient`, sticky per episode) and partial rollout holds: a
call preempted by a weight update is continued on the new weights (`generate_resumable`) and the agent gets one
completion whose tokens keep their versions.

Each episode opens a session and gets a random key (32 bytes): the key is the credential, so calls are attributed
to their episode, one agent cannot reach another's transcript, and a finished or unknown episode's key is a 401.
The server binds loopback by default, and off loopback only with a token (`gateway.token_env`), which then guards
the routes no episode key does (/health and the OpenAPI document).

Agent functions in this process reach the same app without a socket (`Gateway.client`), and a valid
chat-completions call skips FastAPI's routing and parsing (agentrl.fast_path); invalid ones get FastAPI's answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentrl.config.schema import SamplingConfig
from agentrl.envmanager.chat import ChatTokens
from agentrl.fast_path import FastHandler, serve_fast, takes_json
from agentrl.gateway import openai_api as api
from agentrl.gateway.transcript import Prompt, Transcript, template_message
from agentrl.rollout.partial import generate_resumable
from agentrl.types import GenOutput

logger = logging.getLogger(__name__)
# routes no episode key guards; with a token set (required off loopback) they need it
OPEN_PATHS = frozenset({"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
GenerateFn = Callable[[str, list[int], SamplingConfig, str], Awaitable[GenOutput]]


class EpisodeEnded(RuntimeError):
    """A step after the env ended the episode."""


class GatewayError(Exception):
    """An OpenAI-style error answer: status, message, and the error's type / param / code."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param
        self.kind = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error"}.get(
            status, "invalid_request_error" if status < 500 else "server_error"
        )

    def response(self) -> JSONResponse:
        return JSONResponse(api.error_body(str(self), self.kind, self.param, self.code), status_code=self.status)


@dataclass
class Session:
    """One episode's access to the gateway."""

    key: str
    episode_id: str
    sampling: SamplingConfig
    max_calls: int
    transcript: Transcript
    calls: int = 0
    limit: str | None = None  # "max_turns" / "max_total_tokens" once the agent ran into one
    llm_s: float = 0.0  # time its calls spent generating
    running: set[asyncio.Task] = field(default_factory=set)
    task: dict[str, Any] | None = None  # what GET /v1/agentrl/task shows an agent program that runs elsewhere
    step: Callable[[str], Awaitable[Any]] | None = None  # what POST /v1/agentrl/step calls (the episode's env)


@dataclass
class Reply:
    message: dict[str, Any]
    finish: str
    usage: dict[str, int]
    logprobs: dict[str, Any] | None


class Gateway:
    """Sessions, the chat-completions turn, and the HTTP server around them."""

    def __init__(
        self,
        tokenizer: Any,
        generate: GenerateFn,
        *,
        model_name: str = "agentrl",
        parser: str = "hermes",
        max_total_tokens: int = 4096,
        max_body_bytes: int = 4 << 20,
        token: str | None = None,
    ):
        self.tokenizer = tokenizer
        self.generate = generate
        self.model_name = model_name
        self.parser = parser
        self.max_total_tokens = max_total_tokens
        self.max_body_bytes = max_body_bytes
        self.token = token  # guards the routes no episode key does (OPEN_PATHS); required off loopback
        self.sessions: dict[str, Session] = {}
        self._chats: dict[str, ChatTokens] = {}
        self._server: Any = None
        self._serving: asyncio.Task | None = None
        self._asgi: Any = None  # the served app, body limit included (over sockets and in process alike)
        self._in_process: Any = None  # httpx client that calls self._asgi directly (see client())
        self.url = ""
        self.socket_path = ""  # the Unix socket agent commands reach it through (agentrl.gateway.commands)

    # sessions

    def open(self, episode_id: str, sampling: SamplingConfig, max_calls: int) -> Session:
        session = Session(secrets.token_urlsafe(32), episode_id, sampling, max_calls, Transcript(self.chat_for))
        self.sessions[session.key] = session
        return session

    def close(self, session: Session) -> None:
        """Forget the key (later calls get 401) and stop the session's calls still running."""
        self.sessions.pop(session.key, None)
        for task in list(session.running):
            task.cancel()

    def chat_for(self, tools: list[dict] | None) -> ChatTokens:
        key = json.dumps(tools or [], sort_keys=True)
        if key not in self._chats:
            self._chats[key] = ChatTokens(self.tokenizer, tools)
        return self._chats[key]

    def session_for(self, key: str | None) -> Session:
        session = self.sessions.get(key or "")
        if session is None:
            raise GatewayError(
                401, "unknown or finished episode key (each episode gets its own key)", "invalid_api_key"
            )
        return session

    # one turn

    async def complete(self, session: Session, req: api.ChatRequest) -> Reply:
        """One model turn for `session`: render (reusing the episode's tokens), generate, record, answer."""
        tools = req.template_tools()
        prompt, budget = self._prompt(session, req, tools)
        sampling = session.sampling.model_copy(update={"max_tokens": budget})
        t0 = time.perf_counter()
        try:
            out = await generate_resumable(
                lambda ids, s, rid: self.generate(session.episode_id, ids, s, rid),
                prompt.token_ids,
                sampling,
                f"{session.episode_id}-c{session.calls}",
            )
        except GatewayError:
            raise
        except Exception as err:  # a dead or failing engine: the agent's call fails, the gateway stays up
            raise GatewayError(503, f"no rollout engine could serve the call: {type(err).__name__}: {err}") from None
        finally:
            session.llm_s += time.perf_counter() - t0
        chat = prompt.chat
        out, text, stopped = self._cut_at_stop(out, chat, req.stops)
        message, finish = self._message(text, out, bool(tools) and req.tool_choice != "none", stopped)
        session.transcript.record(prompt, out, template_message(message), chat.eos_ids)
        n_prompt = len(prompt.token_ids)
        usage = {
            "prompt_tokens": n_prompt,
            "completion_tokens": len(out.token_ids),
            "total_tokens": n_prompt + len(out.token_ids),
        }
        logprobs = None
        if req.logprobs:
            pieces = [self.tokenizer.decode([t]) for t in out.token_ids]
            logprobs = api.logprobs_out(pieces, out.logprobs)
        return Reply(message, finish, usage, logprobs)

    def _prompt(self, session: Session, req: api.ChatRequest, tools: list | None) -> tuple[Prompt, int]:
        """The call's prompt (rendered by the transcript) and its token budget; a 4xx for the wrong model, an
        episode past its turn or token limit, or messages the chat template rejects."""
        if req.model != self.model_name:
            raise GatewayError(
                404,
                f"model {req.model!r} does not exist; this gateway serves {self.model_name!r}",
                "model_not_found",
                "model",
            )
        if session.calls >= session.max_calls:
            session.limit = "max_turns"
            raise GatewayError(400, f"the episode's turn limit ({session.max_calls} calls) is reached", "max_turns")
        session.calls += 1
        try:
            messages = [template_message(m.model_dump(exclude_none=True)) for m in req.messages]
            prompt = session.transcript.prompt(messages, tools)
        except Exception as err:  # a template that rejects these messages (roles out of order, ...)
            raise GatewayError(
                400, f"the chat template cannot render these messages: {err}", param="messages"
            ) from None
        room = self.max_total_tokens - len(prompt.token_ids)
        if room <= 0:
            session.limit = "max_total_tokens"
            raise GatewayError(
                400,
                f"the episode's {self.max_total_tokens}-token limit is reached (prompt: "
                f"{len(prompt.token_ids)} tokens)",
                "context_length_exceeded",
                "messages",
            )
        return prompt, min(session.sampling.max_tokens, req.token_limit or room, room)

    def _cut_at_stop(self, out: GenOutput, chat: ChatTokens, stops: list[str]) -> tuple[GenOutput, str, bool]:
        """The output up to the first stop string (its tokens through the one that completes it, as vLLM keeps
        them; the text before it, as OpenAI returns it)."""
        text = chat.model_text(out.token_ids)
        hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
        if not hits:
            return out, text, False
        at, stop = min(hits)
        lo, hi = 1, len(out.token_ids)  # the shortest prefix whose text holds the stop string
        while lo < hi:
            mid = (lo + hi) // 2
            if stop in chat.model_text(out.token_ids[:mid]):
                hi = mid
            else:
                lo = mid + 1
        cut = GenOutput(
            out.token_ids[:lo], out.logprobs[:lo], "stop", out.version, out.versions[:lo], resumes=out.resumes
        )
        return cut, text[:at], True

    def _message(self, text: str, out: GenOutput, tools: bool, stopped: bool) -> tuple[dict[str, Any], str]:
        finish = "length" if out.finish_reason == "length" and not stopped else "stop"
        if tools:
            from agentrl.tools.parsers import ToolCall, parse_tool_calls, text_without_calls

            calls = parse_tool_calls(text, self.parser)
            if calls and all(isinstance(c, ToolCall) for c in calls):
                made = api.tool_calls_out([(c.name, json.dumps(c.arguments)) for c in calls])
                content = text_without_calls(text, self.parser)
                return {"role": "assistant", "content": content or None, "tool_calls": made}, (
                    "tool_calls" if finish == "stop" else finish
                )
        return {"role": "assistant", "content": text}, finish

    async def answer(self, session: Session, req: api.ChatRequest) -> Response:
        """The HTTP answer to one chat-completions call: the completion, or its stream of chunks."""
        task = asyncio.current_task()
        session.running.add(task)
        try:
            reply = await self.complete(session, req)
        finally:
            session.running.discard(task)
        cid = api.completion_id()
        if not req.stream:
            body = api.completion(cid, req.model, reply.message, reply.finish, reply.usage, reply.logprobs)
            return JSONResponse(body)
        usage = reply.usage if req.stream_options and req.stream_options.include_usage else None
        events = api.chunks(cid, req.model, reply.message, reply.finish, usage, reply.logprobs)
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return StreamingResponse(iter([body]), media_type="text/event-stream")

    async def _fast_completion(self, body: bytes, headers: dict[bytes, bytes]) -> Response | None:
        """The chat-completions route's fast path (agentrl.fast_path): a call with a live key and a valid body is
        answered here; any other goes to the route, which answers it (401, 400 naming the field, ...)."""
        scheme, _, key = headers.get(b"authorization", b"").partition(b" ")
        session = self.sessions.get(key.strip().decode("latin-1")) if scheme.lower() == b"bearer" else None
        if session is None:
            return None
        try:
            req = api.ChatRequest.model_validate_json(body)
        except ValidationError:
            return None
        try:
            return await self.answer(session, req)
        except GatewayError as err:
            return err.response()

    # HTTP

    def app(self) -> FastAPI:
        app = FastAPI(title="agentrl agent gateway", version="1")
        gateway = self

        bearer = HTTPBearer(auto_error=False, description="the episode's key")  # in the OpenAPI doc too

        async def session(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> Session:
            return gateway.session_for(credentials.credentials if credentials else None)  # async: no thread hop

        _openai_error_bodies(app)

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models(s: Session = Depends(session)) -> dict[str, Any]:
            return {
                "object": "list",
                "data": [{"id": gateway.model_name, "object": "model", "created": 0, "owned_by": "agentrl"}],
            }

        @app.get("/v1/agentrl/task")
        async def task(s: Session = Depends(session)) -> dict[str, Any]:
            """The episode's task, for an agent program that is not Python in this process (an external command)."""
            if s.task is None:
                raise GatewayError(404, "this episode has no task to show")
            return s.task

        @app.post("/v1/agentrl/step")
        async def step(body: api.StepRequest, s: Session = Depends(session)) -> dict[str, Any]:
            """Act in the episode's env: what `task.step(action)` does for an agent in this process."""
            if s.step is None:
                raise GatewayError(404, "this episode has no env to step")
            try:
                result = await s.step(body.action)
            except EpisodeEnded as err:
                raise GatewayError(409, str(err), "episode_ended") from None
            return result._asdict()

        @app.post("/v1/chat/completions", response_model=None)
        async def chat_completions(req: api.ChatRequest, s: Session = Depends(session)) -> Response:
            return await gateway.answer(s, req)

        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on this event loop, over TCP and a Unix socket in a private folder (what a jailed agent command
        reaches); returns the base URL (`.../v1` is the OpenAI base URL)."""
        import tempfile

        import uvicorn

        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        folder = tempfile.mkdtemp(prefix="agentrl-gateway-")
        os.chmod(folder, 0o711)  # a jailed command runs as another uid: it may pass, not list
        self.socket_path = os.path.join(folder, "gateway.sock")
        unix = socket.socket(socket.AF_UNIX)
        unix.bind(self.socket_path)
        os.chmod(self.socket_path, 0o666)  # the key, not the file mode, is what guards an episode
        self._asgi = _Guard(self.app(), self.max_body_bytes, self._fast_completion, self.token)
        config = uvicorn.Config(
            self._asgi,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=60,
        )
        self._server = uvicorn.Server(config)
        self._serving = asyncio.ensure_future(self._server.serve(sockets=[sock, unix]))
        while not self._server.started:
            if self._serving.done():
                self._serving.result()  # raises the start-up error
            await asyncio.sleep(0.01)
        bound_host, bound_port = sock.getsockname()[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        self.url = f"http://{shown}:{bound_port}"
        return self.url

    def client(self, key: str, timeout: float) -> Any:
        """An `openai.AsyncOpenAI` for an agent running in this process, with episode key `key`.

        It sends its requests to the same app the sockets serve (same routes, validation, limits and error bodies),
        called in the agent's own task through httpx's ASGI transport rather than over loopback TCP: no socket,
        HTTP parsing or connection pool on either side, which is most of what a call costs beyond the SDK itself
        (benchmarks/bench_gateway.py). The agent's base URL stays the gateway's real one. Call after `start()`."""
        import httpx
        import openai

        if self._in_process is None:
            transport = httpx.ASGITransport(self._asgi, raise_app_exceptions=False)  # a bug answers 500, as served
            self._in_process = httpx.AsyncClient(transport=transport, timeout=timeout)
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=timeout, http_client=self._in_process
        )

    async def stop(self) -> None:
        for s in list(self.sessions.values()):
            self.close(s)
        if self._in_process is not None:
            await self._in_process.aclose()
            self._in_process = None
        if self._server is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._serving, 10)
        if self.socket_path:
            with contextlib.suppress(OSError):
                os.unlink(self.socket_path)
                os.rmdir(os.path.dirname(self.socket_path))


class _Guard:
    """Pure ASGI, in front of the app: the token on the routes no episode key guards (when one is set); a request
    body over the limit, or one of unknown length, answered before FastAPI reads it (413 / 411); a chat-completions
    call with a JSON body sent down the fast path. Every refusal has an OpenAI-style body."""

    def __init__(self, app: Any, max_bytes: int, fast_completion: FastHandler, token: str | None = None):
        self.app, self.max_bytes, self.fast_completion = app, max_bytes, fast_completion
        self.token = token.encode() if token else None
        self._too_large = functools.partial(_refuse, status=413, message=f"request body over {max_bytes} bytes")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.token is not None and scope["path"] in OPEN_PATHS and not self._has_token(headers):
            return await _refuse(send, 401, "this route needs the gateway's bearer token", "authentication_error")
        if scope["method"] in ("POST", "PUT", "PATCH"):
            length = headers.get(b"content-length")
            if length is None and headers.get(b"transfer-encoding") == b"chunked":
                return await _refuse(send, 411, "send the body with a Content-Length")
            if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
                return await _refuse(send, 413, f"request body over {self.max_bytes} bytes")
            if scope["path"] == "/v1/chat/completions" and not scope.get("root_path") and takes_json(headers):
                fast = self.fast_completion
                return await serve_fast(fast, self.app, scope, receive, send, self.max_bytes, self._too_large)
        await self.app(scope, receive, send)

    def _has_token(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.token or b"")


async def _refuse(send: Any, status: int, message: str, kind: str = "invalid_request_error") -> None:
    body = json.dumps(api.error_body(message, kind)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _openai_error_bodies(app: FastAPI) -> None:
    """Every error as an OpenAI-style body: the gateway's own, request validation (400, naming the field) and
    Starlette's (404 for an unknown route, 405, ...)."""

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, err: GatewayError) -> JSONResponse:
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:])
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid")
        return JSONResponse(api.error_body(message, param=where or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return JSONResponse(api.error_body(str(err.detail), kind), status_code=err.status_code)
