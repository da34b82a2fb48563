"""Tool API: schemas from signatures, validation, timeouts, sessions, the hermes parser and build_toolbox."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated

import pytest
from pydantic import Field

from agentrl.config.schema import ToolsConfig
from agentrl.tools import (
    ParseError,
    Session,
    Tool,
    ToolCall,
    build_toolbox,
    get_parser,
    parse_tool_calls,
    register_parser,
    tool,
)
from agentrl.tools.core import MAX_CONTENT_CHARS


@tool
def add(a: int, b: int = 2) -> int:
    """Add two integers.

    A second paragraph the model does not need.

    Args:
        a: the first number
        b: the second number,
            with a continued description
    """
    return a + b


@tool(timeout_s=0.2)
async def slow(seconds: float) -> str:
    """Sleep, to test timeouts."""
    await asyncio.sleep(seconds)
    return "done"


@tool(timeout_s=0.2)
def slow_sync(seconds: float) -> str:
    """Blocking sleep, to test that sync tools time out too."""
    time.sleep(seconds)
    return "done"


@tool
def boom() -> str:
    """Always fails."""
    raise RuntimeError("kaput")


@tool
def counter(step: Annotated[int, Field(ge=1, le=10)], session: Session) -> int:
    """Per-episode counter."""
    session.state["n"] = session.state.get("n", 0) + step
    return session.state["n"]


def test_schema_from_signature_and_docstring():
    fn = add.schema()["function"]
    assert fn["name"] == "add"
    assert fn["description"] == "Add two integers."
    params = fn["parameters"]
    assert params["type"] == "object"
    assert params["required"] == ["a"]
    assert params["properties"]["a"] == {"type": "integer", "description": "the first number"}
    assert params["properties"]["b"]["default"] == 2
    assert params["properties"]["b"]["description"] == "the second number, with a continued description"
    assert params["additionalProperties"] is False


def test_session_parameter_is_hidden_and_constraints_are_kept():
    props = counter.schema()["function"]["parameters"]["properties"]
    assert set(props) == {"step"}
    assert props["step"]["minimum"] == 1 and props["step"]["maximum"] == 10


def test_from_function_and_bad_names():
    def plain(x: str) -> str:
        return x

    t = Tool.from_function(plain)
    assert t.name == "plain" and Tool.from_function(t) is t
    with pytest.raises(ValueError, match="must match"):
        Tool(plain, name="has space")

    def star(*args: int) -> int:
        return 0

    with pytest.raises(TypeError, match="args"):
        Tool(star)


async def test_call_validates_and_never_raises():
    assert (await add({"a": 1, "b": 5})).content == "6"
    assert (await add({"a": "3"})).content == "5"  # lax JSON-ish coercion, as models often quote numbers
    bad = await add({"a": "x", "c": 1})
    assert not bad.ok
    assert "a:" in bad.error and "c:" in bad.error and bad.content.startswith("Error: ")
    failed = await boom({})
    assert not failed.ok and "RuntimeError: kaput" in failed.error


async def test_timeouts_async_and_sync():
    r = await slow({"seconds": 5})
    assert not r.ok and "timed out after 0.2s" in r.error and r.seconds < 1.0
    r = await slow_sync({"seconds": 1})
    assert not r.ok and "timed out" in r.error and r.seconds < 0.9
    assert (await slow({"seconds": 0.01})).content == "done"


def test_content_is_json_for_structures_and_capped():
    @tool
    def many(n: int) -> object:
        """Big output."""
        return {"x": "y" * n}

    r = asyncio.run(many({"n": 3}))
    assert r.content == '{"x": "yyy"}'
    r = asyncio.run(many({"n": MAX_CONTENT_CHARS * 2}))
    assert len(r.content) < MAX_CONTENT_CHARS + 100 and "truncated" in r.content


def _config(**sets: dict) -> ToolsConfig:
    return ToolsConfig.model_validate({"sets": sets})


async def test_build_toolbox_local_sessions_are_isolated():
    cfg = _config(
        a={"count": {"python": "tests.test_tools_core:counter"}, "add": {"python": "tests.test_tools_core:add"}},
        b={"calc": {"python": "agentrl.tools.calculator:calculator", "timeout_s": 3}},
    )
    box = build_toolbox(cfg, ["a", "b"])
    assert [s["function"]["name"] for s in box.schemas()] == ["count", "add", "calc"]
    assert box.local["calc"].timeout_s == 3
    await box.open_session("ep1")
    await box.open_session("ep2")
    assert (await box.call("count", {"step": 2}, "ep1")).content == "2"
    assert (await box.call("count", {"step": 3}, "ep1")).content == "5"
    assert (await box.call("count", {"step": 1}, "ep2")).content == "1"  # no leak between episodes
    await box.close_session("ep1")
    await box.open_session("ep1")
    assert (await box.call("count", {"step": 1}, "ep1")).content == "1"  # fresh after reopen
    unknown = await box.call("nope", {}, "ep1")
    assert not unknown.ok and "unknown tool 'nope'" in unknown.error and "count" in unknown.error
    not_dict = await box.call("add", ["a"], "ep1")  # type: ignore[arg-type]
    assert not not_dict.ok and "JSON object" in not_dict.error
    await box.aclose()


async def test_session_cleanups_run_on_close():
    closed: list[str] = []

    @tool
    def opener(session: Session) -> str:
        """Registers a cleanup."""
        session.add_cleanup(lambda: closed.append(session.id))
        return "ok"

    from agentrl.tools import Toolbox

    box = Toolbox()
    box.add(opener)
    await box.open_session("s1")
    await box.call("opener", {}, "s1")
    assert closed == []
    await box.close_session("s1")
    assert closed == ["s1"]


def test_build_toolbox_errors_name_the_problem():
    cfg = _config(
        a={"add": {"python": "tests.test_tools_core:add"}}, b={"add": {"python": "tests.test_tools_core:add"}}
    )
    with pytest.raises(ValueError, match="unknown tool set 'zzz'"):
        build_toolbox(cfg, ["zzz"])
    with pytest.raises(ValueError, match="more than one"):
        build_toolbox(cfg, ["a", "b"])
    bad = _config(a={"x": {"python": "no_such_module_xyz:fn"}})
    with pytest.raises(ValueError, match="cannot load tool"):
        build_toolbox(bad, ["a"])
    bad = _config(a={"x": {"python": "no_colon"}})
    with pytest.raises(ValueError, match="module:function"):
        build_toolbox(bad, ["a"])


def test_hermes_parser():
    text = (
        'I will add. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call> and '
        '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
        "<tool_call>{not json}</tool_call>"
        '<tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "x", "arguments": [1]}</tool_call>'
        '<tool_call>{"name": "late", "arguments": {"q": 1}}'  # generation stopped before the closing tag
    )
    calls = parse_tool_calls(text)
    assert calls[0] == ToolCall("add", {"a": 1})
    assert calls[1] == ToolCall("calc", {"expression": "1+1"})
    assert isinstance(calls[2], ParseError) and "not valid JSON" in calls[2].message
    assert isinstance(calls[3], ParseError) and '"name"' in calls[3].message
    assert isinstance(calls[4], ParseError) and "JSON object" in calls[4].message
    assert calls[5] == ToolCall("late", {"q": 1})
    assert parse_tool_calls("no calls here") == []


def test_parser_registry():
    assert get_parser("hermes") is parse_tool_calls.__globals__["parse_hermes"]
    with pytest.raises(KeyError, match="unknown tool-call parser 'zzz'"):
        get_parser("zzz")

    @register_parser("test-upper")
    def upper(text: str) -> list[ToolCall | ParseError]:
        return [ToolCall(text.upper())]

    assert parse_tool_calls("x", parser="test-upper") == [ToolCall("X")]
