"""`agentrl serve-tools` over MCP, driven by the official `mcp` SDK's own client: the same tools, token, timeouts
and per-episode sessions as the REST routes."""

from __future__ import annotations

import asyncio

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from agentrl.tools import Session, tool
from agentrl.tools.calculator import calculator
from agentrl.tools.serve import ServerThread
from agentrl.tools.server import create_app

TOKEN = "mcp-token-0123456789"


@tool
def note(text: str, session: Session) -> str:
    """Append to a per-episode notebook and return it."""
    notes = session.state.setdefault("notes", [])
    notes.append(text)
    return " | ".join(notes)


@tool(timeout_s=0.5)
async def slow(seconds: float) -> str:
    """Sleep, then say so."""
    await asyncio.sleep(seconds)
    return "done"


@pytest.fixture(scope="module")
def url():
    with ServerThread(create_app([calculator, note, slow], token=TOKEN)) as base:
        yield base


def _client(url: str, token: str = TOKEN, episode: str | None = None) -> Client:
    headers = {"Authorization": f"Bearer {token}", **({"Agentrl-Session": episode} if episode else {})}
    return Client(streamable_http_client(f"{url}/mcp", http_client=httpx2.AsyncClient(headers=headers)))


async def test_tools_listed_and_called_over_mcp(url):
    async with _client(url) as client:
        listed = await client.list_tools()
        assert {t.name for t in listed.tools} == {"calculator", "note", "slow"}
        calc = next(t for t in listed.tools if t.name == "calculator")
        assert "expression" in calc.input_schema["properties"]
        result = await client.call_tool("calculator", {"expression": "6*7"})
        assert not result.is_error and result.content[0].text == "42"
        bad = await client.call_tool("calculator", {"expression": "import os"})
        assert bad.is_error and bad.content[0].text.startswith("error:")
        timed_out = await client.call_tool("slow", {"seconds": 5})  # the tool's own 0.5 s limit
        assert timed_out.is_error and "timed out" in timed_out.content[0].text
        typo = await client.call_tool("calculator", {"expr": "1+1"})  # validated as the REST route does
        assert typo.is_error and "expression" in typo.content[0].text
        unknown = await client.call_tool("nope", {})
        assert unknown.is_error and "available tools: calculator, note, slow" in unknown.content[0].text


async def test_episodes_keep_their_own_sessions_over_mcp(url):
    async with _client(url, episode="train/x/1/0") as a, _client(url, episode="train/x/1/1") as b:
        assert (await a.call_tool("note", {"text": "a1"})).content[0].text == "a1"
        assert (await b.call_tool("note", {"text": "b1"})).content[0].text == "b1"
        assert (await a.call_tool("note", {"text": "a2"})).content[0].text == "a1 | a2"
    # the REST routes see and close the same session
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=url, headers=auth) as rest:
        r = await rest.post("/tools/note/call", json={"arguments": {"text": "a3"}, "session_id": "train/x/1/0"})
        assert r.json()["content"] == "a1 | a2 | a3"
        assert (await rest.post("/sessions/close", json={"session_id": "train/x/1/0"})).status_code == 200
    async with _client(url, episode="train/x/1/0") as a:
        assert (await a.call_tool("note", {"text": "new"})).content[0].text == "new"


async def test_mcp_needs_the_token(url):
    async with httpx.AsyncClient(base_url=url) as http:
        r = await http.post("/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
        assert r.status_code == 401
    with pytest.raises(Exception):  # noqa: B017 - the SDK raises its own error for the 401
        async with _client(url, token="wrong") as client:
            await client.list_tools()
