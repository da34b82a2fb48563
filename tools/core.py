"""Typed tools: a Python function (sync or async) plus the OpenAI function schema pydantic derives from it.

Why pydantic: the same model that produces the schema the model sees also validates the arguments the model
sends, so the two can never drift apart. Stateful tools declare a parameter annotated `Session`; it is
injected per episode (never part of the schema), so state cannot leak between episodes.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import re
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

MAX_CONTENT_CHARS = 16_384  # what goes back to the model is capped; long outputs waste context


class ToolResult(BaseModel):
    """The outcome of one call. `content` is what the model sees, also on failure (then it says why)."""

    content: str
    ok: bool = True
    error: str | None = None
    seconds: float = 0.0

    @classmethod
    def failure(cls, error: str, seconds: float = 0.0) -> ToolResult:
        return cls(content=f"Error: {error}", ok=False, error=error, seconds=seconds)


class Session:
    """Per-episode state for stateful tools: a dict, plus cleanups that run when the session closes."""

    def __init__(self, session_id: str) -> None:
        self.id = session_id
        self.state: dict[str, Any] = {}
        self._cleanups: list[Callable[[], Any]] = []

    def add_cleanup(self, fn: Callable[[], Any]) -> None:
        self._cleanups.append(fn)

    async def close(self) -> None:
        for fn in reversed(self._cleanups):
            try:
                out = fn()
                if inspect.isawaitable(out):
                    await out
            except Exception:  # a failing cleanup must not keep the others from running
                pass
        self._cleanups.clear()
        self.state.clear()


class SessionStore:
    """Open sessions by id, bounded so a client that never closes cannot exhaust memory."""

    def __init__(self, max_sessions: int = 10_000) -> None:
        self.max_sessions = max_sessions
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def open(self, session_id: str) -> Session:
        """Open (or return the already open) session; raises OverflowError when the store is full."""
        session = self._sessions.get(session_id)
        if session is None:
            if len(self._sessions) >= self.max_sessions:
                raise OverflowError(f"too many open sessions (limit {self.max_sessions})")
            session = self._sessions[session_id] = Session(session_id)
        return session

    async def close(self, session_id: str) -> bool:
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        await session.close()
        return True

    async def close_all(self) -> None:
        for sid in list(self._sessions):
            await self.close(sid)


def _doc_parts(doc: str | None) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into (description, {arg: description})."""
    doc = inspect.cleandoc(doc or "")
    m = re.search(r"^(Args|Arguments|Parameters):\s*$", doc, flags=re.M)
    head, rest = (doc[: m.start()], doc[m.end() :]) if m else (doc, "")
    args: dict[str, str] = {}
    current = None
    for line in rest.splitlines():
        if not line.strip():
            continue
        if re.match(r"^\S", line):  # an unindented line starts the next section (Returns:, Raises:)
            break
        m = re.match(r"^\s{1,6}(\w+)\s*(\([^)]*\))?\s*:\s*(.*)$", line)
        if m:
            current = m.group(1)
            args[current] = m.group(3).strip()
        elif current:
            args[current] = (args[current] + " " + line.strip()).strip()
    description = " ".join(head.strip().split("\n\n")[0].split())
    return description, args


def _clean_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Drop pydantic's auto titles: they add tokens to every prompt and tell the model nothing."""
    schema.pop("title", None)
    for prop in schema.get("properties", {}).values():
        if isinstance(prop, dict):
            prop.pop("title", None)
    return schema


class Tool:
    """A callable tool: name, description, argument model (schema + validation) and the function."""

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str | None = None,
        description: str | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.fn = fn
        self.name = name or fn.__name__
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.name):
            raise ValueError(f"tool name {self.name!r} must match [A-Za-z0-9_-]{{1,64}} (OpenAI rule)")
        doc_description, arg_docs = _doc_parts(fn.__doc__)
        self.description = description or doc_description or self.name
        self.timeout_s = timeout_s
        # Why the tool cannot run on this machine (None: it can); asked before serving, so a server that could
        # only refuse every call does not start.
        self.check: Callable[[], str | None] | None = None
        self.is_async = inspect.iscoroutinefunction(fn)
        self.session_param: str | None = None
        hints = get_type_hints(fn, include_extras=True)
        fields: dict[str, Any] = {}
        for pname, param in inspect.signature(fn).parameters.items():
            ann = hints.get(pname, Any)
            if ann is Session:
                self.session_param = pname
                continue
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise TypeError(f"tool {self.name}: *args/**kwargs cannot be described to a model")
            default = ... if param.default is param.empty else param.default
            fields[pname] = (ann, Field(default, description=arg_docs.get(pname)))
        self.args_model: type[BaseModel] = create_model(
            f"{self.name}_args", __config__=ConfigDict(extra="forbid"), **fields
        )
        self.parameters = _clean_schema(self.args_model.model_json_schema())
        self.parameters.setdefault("properties", {})

    @classmethod
    def from_function(cls, fn: Callable[..., Any], **kwargs: Any) -> Tool:
        return fn if isinstance(fn, Tool) else cls(fn, **kwargs)

    def schema(self) -> dict[str, Any]:
        """The OpenAI function schema, as chat templates take it in `tools=`."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def validate(self, arguments: Any) -> BaseModel:
        """Arguments -> the typed model; raises ValidationError naming the bad field."""
        if isinstance(arguments, self.args_model):
            return arguments
        return self.args_model.model_validate(arguments)

    async def run(self, args: BaseModel, session: Session | None, timeout_s: float | None = None) -> ToolResult:
        """Run on validated args; never raises for tool failures (they become ok=False results)."""
        start = time.perf_counter()
        kwargs = {name: getattr(args, name) for name in type(args).model_fields}
        if self.session_param is not None:
            kwargs[self.session_param] = session if session is not None else Session("ephemeral")
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        try:
            if self.is_async:
                value = await _with_timeout(self.fn(**kwargs), timeout)
            else:
                call = functools.partial(self.fn, **kwargs)
                value = await _with_timeout(asyncio.get_running_loop().run_in_executor(None, call), timeout)
        except TimeoutError:
            return ToolResult.failure(f"{self.name} timed out after {timeout:g}s", time.perf_counter() - start)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            msg = f"{self.name} failed: {type(err).__name__}: {err}"
            return ToolResult.failure(msg, time.perf_counter() - start)
        return ToolResult(content=to_content(value), seconds=time.perf_counter() - start)

    async def __call__(self, arguments: dict[str, Any], session: Session | None = None) -> ToolResult:
        """Validate then run: the convenient path for tests and one-off calls."""
        try:
            args = self.validate(arguments)
        except ValidationError as err:
            return ToolResult.failure(format_validation_error(self.name, err))
        return await self.run(args, session)

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"


async def _with_timeout(aw: Awaitable[Any], timeout: float | None) -> Any:
    if timeout is None:
        return await aw
    if sys.version_info >= (3, 11):  # asyncio.timeout needs no extra task, which matters at high call rates
        async with asyncio.timeout(timeout):
            return await aw
    return await asyncio.wait_for(aw, timeout)  # pragma: no cover


def to_content(value: Any, limit: int = MAX_CONTENT_CHARS) -> str:
    """Tool return value -> text for the model (JSON for structured values), capped at `limit` chars."""
    if isinstance(value, BaseModel):
        text = value.model_dump_json()
    elif isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            text = str(value)
    if len(text) > limit:
        text = text[:limit] + f"\n...[truncated {len(text) - limit} chars]"
    return text


def format_validation_error(tool_name: str, err: ValidationError) -> str:
    """One line per bad field, naming it, so the model can fix its call."""
    parts = []
    for e in err.errors(include_url=False):
        loc = ".".join(str(p) for p in e["loc"]) or "arguments"
        parts.append(f"{loc}: {e['msg']}")
    return f"invalid arguments for {tool_name}: " + "; ".join(parts)


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float | None = None,
) -> Any:
    """Decorator: `@tool` or `@tool(name=..., timeout_s=...)` turns a typed function into a `Tool`."""

    def wrap(f: Callable[..., Any]) -> Tool:
        return Tool(f, name=name, description=description, timeout_s=timeout_s)

    return wrap(fn) if fn is not None else wrap
