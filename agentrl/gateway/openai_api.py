"""The OpenAI chat-completions wire format the gateway speaks: the request it accepts, the bodies it answers.

The request model is strict where a silent difference would mislead an agent or its training: a parameter the
gateway cannot honour (n > 1, penalties, logit bias, a forced tool choice, top log-probs, structured output) is a
400 naming it, never ignored. Fields that change nothing about sampling (user, metadata, store,
parallel_tool_calls, stream_options, seed) are accepted. Replies are built as plain dicts in the shape the
`openai` SDK parses (its own types check them in the tests).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP = 4  # OpenAI's limit on stop sequences


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # SDK fields the gateway does not read (refusal, audio, ...)


class FunctionCall(_Open):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(_Open):
    type: Literal["text"]
    text: str


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class FunctionDef(_Open):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(_Open):
    include_usage: bool = False


class ChatRequest(_Strict):
    """POST /v1/chat/completions, as far as the gateway honours it."""

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    n: Literal[1] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | None = None
    top_logprobs: Literal[0] | None = None
    seed: int | None = None
    presence_penalty: Literal[0] | None = None
    frequency_penalty: Literal[0] | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str] | None:
        stops = [v] if isinstance(v, str) else v
        if stops is not None and (len(stops) > MAX_STOP or not all(stops)):
            raise ValueError(f"stop takes at most {MAX_STOP} non-empty strings")
        return stops

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_tools(self) -> list[dict] | None:
        """The tool list as chat templates take it (OpenAI's function-tool objects)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class StepRequest(_Strict):
    """POST /v1/agentrl/step: the agent's action, as the env reads model output."""

    action: str = Field(max_length=1 << 16)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None):
    """OpenAI's error object: the SDK raises it as `openai.APIStatusError` subclasses with this message."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def tool_calls_out(calls: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """(name, JSON arguments) pairs as OpenAI tool calls, each with a fresh id."""
    return [
        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": n, "arguments": a}}
        for n, a in calls
    ]


def logprobs_out(tokens: list[str], logprobs: list[float]) -> dict[str, Any]:
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(tokens, logprobs, strict=True)
        ],
        "refusal": None,
    }


def completion(
    cid: str, model: str, message: dict[str, Any], finish: str, usage: dict[str, int], logprobs: dict | None
) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}],
        "usage": usage,
    }


def chunks(
    cid: str, model: str, message: dict[str, Any], finish: str, usage: dict[str, int] | None, logprobs: dict | None
) -> list[dict[str, Any]]:
    """A finished completion as stream chunks: the role, the content, the tool calls, the finish reason, and the
    usage when asked for (`stream_options.include_usage`)."""
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish_reason: str | None = None, lp: dict | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": lp}
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}

    out = [chunk({"role": "assistant", "content": ""})]
    if message.get("content"):
        out.append(chunk({"content": message["content"]}, lp=logprobs))
    for i, call in enumerate(message.get("tool_calls") or []):
        out.append(chunk({"tool_calls": [{"index": i, **call}]}))
    out.append(chunk({}, finish))
    if usage is not None:
        out.append(
            {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [],
                "usage": usage,
            }
        )
    return out
