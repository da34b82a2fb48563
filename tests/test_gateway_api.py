"""The gateway's OpenAI API through the real `openai` SDK, with a scripted engine (a stand-in that returns given
texts as tokens, so tool calls and stop strings are certain; the real vLLM engine's tests are in
test_gateway_vllm.py): tool-call round trips, streaming, stop strings, log-probs, per-episode keys, and every bad
request answered with an OpenAI-style 4xx."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from agentrl.config.schema import SamplingConfig
from agentrl.gateway.server import Gateway
from agentrl.types import GenOutput

MOVE = {
    "type": "function",
    "function": {
        "name": "move",
        "description": "Move the player.",
        "parameters": {"type": "object", "properties": {"direction": {"type": "string"}}},
    },
}
CALL = '<tool_call>{"name": "move", "arguments": {"direction": "up"}}</tool_call>'
pytestmark = pytest.mark.asyncio(loop_scope="session")  # the gateway fixture serves on the session's loop
START = [{"role": "system", "content": "Push the box."}, {"role": "user", "content": "#P X#"}]


class ScriptedEngine:
    """Stands in for an engine: each call returns the next scripted text's tokens (+ EOS), within the budget."""

    def __init__(self, tok):
        self.tok, self.script, self.prompts = tok, [], []

    async def generate(self, episode_id: str, ids: list[int], sampling: SamplingConfig, rid: str) -> GenOutput:
        self.prompts.append((episode_id, list(ids)))
        text = self.script.pop(0) if self.script else "<answer>Up</answer>"
        out = [*self.tok.encode(text, add_special_tokens=False), self.tok.eos_token_id]
        finish = "length" if len(out) > sampling.max_tokens else "stop"
        out = out[: sampling.max_tokens]
        return GenOutput(out, [-0.25 - 0.01 * i for i in range(len(out))], finish, 3)


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture
async def gateway(tok):
    engine = ScriptedEngine(tok)
    gw = Gateway(tok, engine.generate, max_total_tokens=2000, max_body_bytes=64 << 10)
    gw.engine = engine
    await gw.start()
    yield gw
    await gw.stop()


@pytest.fixture(params=["http", "in_process"])
def client_for(request, gateway):
    """An SDK client for an episode key: over loopback HTTP (what an agent command uses), or in process through
    `Gateway.client` (what an agent function gets: the same app called without a socket)."""
    if request.param == "in_process":
        return lambda key: gateway.client(key, timeout=30)
    return lambda key: openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)


async def test_tool_call_round_trip_reuses_the_episode_tokens(gateway, client_for, tok):
    s = gateway.open("ep-1", SamplingConfig(max_tokens=200), max_calls=4)
    gateway.engine.script += [CALL, "<answer>done</answer>"]
    client = client_for(s.key)
    messages = list(START)
    r1 = await client.chat.completions.create(model="agentrl", messages=messages, tools=[MOVE])
    msg = r1.choices[0].message
    assert r1.choices[0].finish_reason == "tool_calls" and msg.content is None
    (call,) = msg.tool_calls
    assert call.function.name == "move" and json.loads(call.function.arguments) == {"direction": "up"}
    messages += [msg, {"role": "tool", "tool_call_id": call.id, "content": "moved up"}]  # the SDK object, as is
    r2 = await client.chat.completions.create(model="agentrl", messages=messages, tools=[MOVE])
    assert r2.choices[0].message.content == "<answer>done</answer>" and r2.choices[0].finish_reason == "stop"
    t = s.transcript
    assert len(t.lines) == 1 and len(t.turns) == 2  # the second call continued the first's tokens
    (_, p1), (_, p2) = gateway.engine.prompts
    first = p1 + t.turns[0].token_ids
    assert p2[: len(first)] == first and "moved up" in tok.decode(p2[len(first) :])
    assert r2.usage.prompt_tokens == len(p2) and r2.usage.completion_tokens == len(t.turns[1].token_ids)
    assert set(t.main.versions) == {-1, 3}


async def test_streaming_gives_the_same_completion(gateway, client_for):
    s = gateway.open("ep-2", SamplingConfig(max_tokens=200), max_calls=4)
    gateway.engine.script += ["Going up. " + CALL]
    stream = await client_for(s.key).chat.completions.create(
        model="agentrl", messages=START, tools=[MOVE], stream=True, stream_options={"include_usage": True}
    )
    content, calls, finish, usage = "", {}, None, None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for c in choice.delta.tool_calls or []:
                calls.setdefault(c.index, {"name": "", "arguments": ""})
                calls[c.index]["name"] += c.function.name or ""
                calls[c.index]["arguments"] += c.function.arguments or ""
            finish = choice.finish_reason or finish
    assert content == "Going up." and finish == "tool_calls"
    assert calls[0]["name"] == "move" and json.loads(calls[0]["arguments"]) == {"direction": "up"}
    assert usage.completion_tokens == len(s.transcript.turns[0].token_ids)


async def test_stop_strings_and_logprobs(gateway, client_for, tok):
    s = gateway.open("ep-3", SamplingConfig(max_tokens=200), max_calls=4)
    gateway.engine.script += ["<answer>Up</answer> and then more"]
    r = await client_for(s.key).chat.completions.create(
        model="agentrl", messages=START, stop=["</answer>"], logprobs=True
    )
    assert r.choices[0].message.content == "<answer>Up" and r.choices[0].finish_reason == "stop"
    (turn,) = s.transcript.turns
    assert tok.decode(turn.token_ids).endswith("</answer>")  # recorded through the token that completed the stop
    assert [c.logprob for c in r.choices[0].logprobs.content] == pytest.approx(turn.logprobs)
    assert "".join(c.token for c in r.choices[0].logprobs.content) == tok.decode(turn.token_ids)


async def test_keys_isolate_episodes(gateway, client_for):
    a = gateway.open("ep-a", SamplingConfig(max_tokens=50), max_calls=4)
    b = gateway.open("ep-b", SamplingConfig(max_tokens=50), max_calls=4)
    gateway.engine.script += ["from a", "from b"]
    await client_for(a.key).chat.completions.create(model="agentrl", messages=START)
    await client_for(b.key).chat.completions.create(model="agentrl", messages=START)
    assert [e for e, _ in gateway.engine.prompts] == ["ep-a", "ep-b"]
    assert a.transcript.messages[-1]["content"] == "from a" and b.transcript.messages[-1]["content"] == "from b"
    gateway.close(a)
    with pytest.raises(openai.AuthenticationError):  # a finished episode's key is dead
        await client_for(a.key).chat.completions.create(model="agentrl", messages=START)
    with pytest.raises(openai.AuthenticationError):
        await client_for("guess").models.list()
    models = await client_for(b.key).models.list()
    assert [m.id for m in models.data] == ["agentrl"]


async def test_bad_requests_get_openai_style_4xx(gateway, client_for):
    s = gateway.open("ep-bad", SamplingConfig(max_tokens=50), max_calls=1)
    client = client_for(s.key)
    expected = [
        (dict(model="gpt-4o", messages=START), openai.NotFoundError, "does not exist"),
        (dict(model="agentrl", messages=START, n=2), openai.BadRequestError, "n"),
        (dict(model="agentrl", messages=START, top_logprobs=3, logprobs=True), openai.BadRequestError, "top_logprobs"),
        (dict(model="agentrl", messages=START, tool_choice="required", tools=[MOVE]), openai.BadRequestError, "tool"),
        (dict(model="agentrl", messages=[]), openai.BadRequestError, "messages"),
        (dict(model="agentrl", messages=[{"role": "robot", "content": "x"}]), openai.BadRequestError, "role"),
        (dict(model="agentrl", messages=START, presence_penalty=0.5), openai.BadRequestError, "presence_penalty"),
        (dict(model="agentrl", messages=START, stop=["a", "b", "c", "d", "e"]), openai.BadRequestError, "stop"),
    ]
    for kwargs, error, words in expected:
        with pytest.raises(error) as info:
            await client.chat.completions.create(**kwargs)
        assert words in info.value.message, (kwargs, info.value.message)
    assert gateway.engine.prompts == []  # none of them reached the engine
    raw = httpx.AsyncClient(base_url=gateway.url, headers={"Authorization": f"Bearer {s.key}"})
    r = await raw.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    big = {"model": "agentrl", "messages": [{"role": "user", "content": "x" * (70 << 10)}]}
    r = await raw.post("/v1/chat/completions", json=big)
    assert r.status_code == 413 and "bytes" in r.json()["error"]["message"]
    assert (await raw.get("/v1/nothing")).status_code == 404
    gateway.engine.script += ["one"]
    await client.chat.completions.create(model="agentrl", messages=START)
    with pytest.raises(openai.BadRequestError) as info:  # the episode's turn limit (max_calls=1)
        await client.chat.completions.create(model="agentrl", messages=START)
    assert info.value.code == "max_turns" and s.limit == "max_turns"
    await raw.aclose()


async def test_the_episode_token_limit_is_a_4xx_and_bounds_the_budget(gateway, client_for, tok):
    s = gateway.open("ep-long", SamplingConfig(max_tokens=500), max_calls=8)
    client = client_for(s.key)
    long_obs = [START[0], {"role": "user", "content": "word " * 1990}]
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model="agentrl", messages=long_obs)
    assert info.value.code == "context_length_exceeded" and s.limit == "max_total_tokens"
    gateway.engine.script += ["x " * 100]
    r = await client.chat.completions.create(model="agentrl", messages=START, max_tokens=7)
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"


@pytest.mark.heavy
async def test_fuzzed_requests_never_get_a_5xx(gateway):
    """schemathesis over the gateway's own OpenAPI document, valid and invalid requests, with an episode's key (the
    model id pinned to the served one, so valid requests reach the engine): no 5xx, documented answers."""
    import asyncio

    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode, openapi

    s = gateway.open("ep-fuzz", SamplingConfig(max_tokens=16), max_calls=10**6)
    auth = {"Authorization": f"Bearer {s.key}"}
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        raw = (await http.get("/openapi.json")).json()
    raw["components"]["schemas"]["ChatRequest"]["properties"]["model"] = {"type": "string", "enum": ["agentrl"]}
    operations = [r.ok() for r in openapi.from_dict(raw).get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/chat/completions", "GET /v1/models"}
    statuses: dict[int, int] = {}
    failures: list[str] = []

    def fuzz(op, mode) -> None:
        @settings(
            max_examples=120, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
        )
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case):
            response = case.call(base_url=gateway.url, headers=auth, timeout=30)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            if response.status_code >= 500:
                failures.append(f"{op.label} [{mode.value}] -> {response.status_code}: {case.body!r:.300}")
            elif response.status_code >= 400 and "error" not in response.json():
                failures.append(f"{op.label}: a {response.status_code} without an OpenAI error body")

        run()

    def all_ops() -> None:
        for op in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                if mode is GenerationMode.POSITIVE or op.body:  # the key header is set by the test, not fuzzed
                    fuzz(op, mode)

    await asyncio.to_thread(all_ops)  # the server answers on this loop meanwhile
    print(f"gateway fuzz: {sum(statuses.values())} requests, statuses {dict(sorted(statuses.items()))}")
    assert not failures, f"{len(failures)} failures, first: {failures[:3]}"
    assert statuses.get(200, 0) > 50 and statuses.get(400, 0) > 50, statuses  # both kinds really ran


async def test_off_loopback_needs_a_token_which_guards_the_open_routes(tok, monkeypatch):
    from agentrl.config.schema import GatewayConfig

    with pytest.raises(ValueError, match=r"off loopback: set gateway\.token_env"):
        GatewayConfig(host="0.0.0.0")
    with pytest.raises(ValueError, match="GW_TOKEN_T: the variable is not set"):
        GatewayConfig(host="0.0.0.0", token_env="GW_TOKEN_T")
    monkeypatch.setenv("GW_TOKEN_T", "s3cret")
    assert GatewayConfig(host="0.0.0.0", token_env="GW_TOKEN_T").token() == "s3cret"
    assert GatewayConfig().token() is None  # loopback: no token needed

    engine = ScriptedEngine(tok)
    gw = Gateway(tok, engine.generate, token="s3cret")
    await gw.start()  # loopback here: what the token guards is the same on any address
    try:
        async with httpx.AsyncClient(base_url=gw.url) as raw:
            for path in ("/health", "/openapi.json"):
                r = await raw.get(path)
                assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
                assert (await raw.get(path, headers={"Authorization": "Bearer wrong"})).status_code == 401
                assert (await raw.get(path, headers={"Authorization": "Bearer s3cret"})).status_code == 200
            assert (await raw.get("/v1/models", headers={"Authorization": "Bearer s3cret"})).status_code == 401
        s = gw.open("ep-tok", SamplingConfig(max_tokens=20), max_calls=2)  # agents still use their episode's key
        r = await openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=s.key).chat.completions.create(
            model="agentrl", messages=START
        )
        assert r.choices[0].message.content == "<answer>Up</answer>"
    finally:
        await gw.stop()
