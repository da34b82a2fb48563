"""Env manager logic with a scripted engine (a stand-in that replays expert text as tokens, no model): token-exact
history, samples, tool calls, crashing envs, 256 concurrent episodes. The real-engine tests are in
test_envmanager_vllm.py."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from typing import ClassVar

import pytest

from agentrl.config.schema import EnvsConfig, SamplingConfig, ToolsConfig, ToolSpec
from agentrl.envmanager.episode import EpisodeRunner
from agentrl.envmanager.samples import to_samples
from agentrl.envs import TextEnv, make_env, register_env
from agentrl.envs.sokoban.env import SokobanEnv
from agentrl.types import EpisodeSpec, GenOutput


class FlakySokoban(SokobanEnv):
    """Raises on ~10% of steps (seeded), to show a crashing env fails only its own episode."""

    def step(self, action):
        if self._flaky_rng.random() < 0.1:
            raise RuntimeError("flaky env exploded")
        return super().step(action)

    def reset(self, *, seed=None, options=None):
        self._flaky_rng = random.Random(seed)
        return super().reset(seed=seed, options=options)


class HangSokoban(SokobanEnv):
    """Every step of an episode whose seed is a multiple of 4 hangs 5 s (a blocking call gone wrong)."""

    def reset(self, *, seed=None, options=None):
        self.hangs = seed is not None and seed % 4 == 0
        return super().reset(seed=seed, options=options)

    def step(self, action):
        if self.hangs:
            time.sleep(5)
        return super().step(action)


register_env("test/HangSokoban-v0", f"{__name__}:HangSokoban", dim_room=(6, 6), num_boxes=1, max_steps=15)
register_env("test/FlakySokoban-v0", f"{__name__}:FlakySokoban", dim_room=(6, 6), num_boxes=1, max_steps=15)


class PoolSokoban(SokobanEnv):
    """Records the thread of every step; declares no `inline_step`, as a user's subclass would not."""

    threads: ClassVar[set[str]] = set()

    def step(self, action):
        type(self).threads.add(threading.current_thread().name)
        return super().step(action)


class LoopSokoban(PoolSokoban):
    inline_step = True
    threads: ClassVar[set[str]] = set()


SIMPLE = {"dim_room": (6, 6), "num_boxes": 1, "inner_walls": (0, 3), "max_steps": 15}  # SimpleSokoban-v0's levels
register_env("test/PoolSokoban-v0", f"{__name__}:PoolSokoban", **SIMPLE)
register_env("test/LoopSokoban-v0", f"{__name__}:LoopSokoban", **SIMPLE)


class ScriptedEngine:
    """Answers each request with a scripted text per episode, tokenised with the real tokenizer (+ EOS)."""

    def __init__(self, tokenizer, script, delay_s: float = 0.0):
        self.tok, self.script, self.delay_s = tokenizer, script, delay_s
        self.calls = 0

    async def __call__(self, episode_id, ids, sampling, rid) -> GenOutput:
        self.calls += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        text = self.script(episode_id, self.tok.decode(ids))
        out = self.tok(text, add_special_tokens=False)["input_ids"][: sampling.max_tokens - 1]
        out.append(self.tok.eos_token_id)
        return GenOutput(out, [-0.5] * len(out), "stop", 0)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def _expert_script():
    envs: dict[str, SokobanEnv] = {}

    def script(episode_id: str, prompt_text: str) -> str:
        env = envs.get(episode_id)
        if env is None:  # replay the same level to know the expert move
            seed = int(episode_id.split("/")[-2])
            env = envs[episode_id] = make_env("agentrl/SimpleSokoban-v0")
            env.reset(seed=seed)
        action = env.expert_action()
        env.step(action)
        return action

    return script


def _runner(tokenizer, engine, **envs) -> EpisodeRunner:
    return EpisodeRunner(tokenizer, engine, lambda i, k: make_env(i, **k), EnvsConfig(**envs), ToolsConfig())


def _spec(seed: int, env_id: str = "agentrl/SimpleSokoban-v0", **kw) -> EpisodeSpec:
    return EpisodeSpec(env_id, seed, "sokoban", max_turns=15, **kw)


async def test_token_exact_history_and_mask(tokenizer):
    engine = ScriptedEngine(tokenizer, _expert_script())
    runner = _runner(tokenizer, engine)
    ep = await runner.run(_spec(11))
    assert ep.error is None and ep.metrics["success"] == 1.0 and len(ep.turns) >= 2
    rendered = tokenizer.apply_chat_template(ep.messages, tokenize=False)
    # the trajectory ends at the model's last end-of-turn token; the template adds a newline after it
    assert tokenizer.decode(ep.token_ids) == rendered.removesuffix("\n")
    model_tokens = [t for turn in ep.turns for t in turn.token_ids]
    assert [t for t, m in zip(ep.token_ids, ep.loss_mask, strict=True) if m] == model_tokens
    assert all(v == 0 for v, m in zip(ep.versions, ep.loss_mask, strict=True) if m)
    assert all(v == -1 and lp == 0.0 for v, lp, m in zip(ep.versions, ep.logprobs, ep.loss_mask, strict=True) if not m)
    (sample,) = to_samples(ep, ep.env_return, "trajectory")
    assert sample.reward == pytest.approx(sum(t.reward for t in ep.turns)) and ep.truncation is None
    assert sample.step_rewards[-1] > 10  # the solve bonus lands on the last turn


async def test_only_env_classes_that_declare_inline_step_step_on_the_event_loop(tokenizer):
    """Sokoban's step runs on the env manager's loop (no thread hop); a class that does not declare inline_step
    itself (a subclass's step may block) steps on the thread pool, under envs.call_timeout_s."""
    assert SokobanEnv.inline_step and LoopSokoban.inline_step
    assert not TextEnv.inline_step and not PoolSokoban.inline_step and not FlakySokoban.inline_step
    for env_id in ("test/PoolSokoban-v0", "test/LoopSokoban-v0"):
        ep = await _runner(tokenizer, ScriptedEngine(tokenizer, _expert_script())).run(_spec(11, env_id))
        assert ep.error is None and ep.metrics["success"] == 1.0, (env_id, ep.error)
    loop_thread = threading.current_thread().name
    assert PoolSokoban.threads and loop_thread not in PoolSokoban.threads, PoolSokoban.threads
    assert LoopSokoban.threads == {loop_thread}


async def test_step_wise_samples_and_history_window(tokenizer):
    runner = _runner(tokenizer, ScriptedEngine(tokenizer, _expert_script()), sample_mode="turn")
    ep = await runner.run(_spec(12))
    samples = to_samples(ep, ep.env_return, "step")
    assert len(samples) == len(ep.turns) >= 2
    second = tokenizer.decode(samples[1].token_ids)
    assert second.count("<|im_start|>user") == 1 and second.count("<|im_start|>assistant") == 1
    assert [s.turn_index for s in samples] == list(range(len(samples)))
    windowed = _runner(
        tokenizer, ScriptedEngine(tokenizer, _expert_script()), sample_mode="turn", turn_history_window=1
    )
    ep2 = await windowed.run(_spec(12))
    text = tokenizer.decode(to_samples(ep2, 0.0, "step")[1].token_ids)
    assert text.count("<|im_start|>user") == 2 and text.count("<|im_start|>assistant") == 2


async def test_limits_name_the_truncation(tokenizer):
    wander = ScriptedEngine(tokenizer, lambda e, p: "<answer>Up</answer>")
    ep = await _runner(tokenizer, wander).run(EpisodeSpec("agentrl/SimpleSokoban-v0", 3, "s", max_turns=2))
    assert ep.truncation == "max_turns" and len(ep.turns) == 2
    ep = await _runner(tokenizer, wander, max_total_tokens=200).run(_spec(3))
    assert ep.truncation == "max_total_tokens" and len(ep.token_ids) <= 200


async def test_crashing_env_fails_only_its_episodes(tokenizer):
    runner = _runner(tokenizer, ScriptedEngine(tokenizer, lambda e, p: "<answer>Left</answer>"))
    results = await asyncio.gather(*(runner.run(_spec(s, "test/FlakySokoban-v0")) for s in range(60)))
    failed = [r for r in results if r.failed]
    assert 5 <= len(failed) < 60 and all("flaky env exploded" in r.error for r in failed)
    assert all(r.truncation is not None for r in results if not r.failed)


async def test_hung_env_calls_never_starve_the_other_episodes(tokenizer):
    """More hung steps than env threads: a hung call gives its slot up at its timeout, and the other episodes'
    calls are timed from when they start, not while they queue. Behind a fixed 2-thread pool the two hung calls
    held both threads and every other episode's step timed out in the queue."""
    runner = _runner(
        tokenizer, ScriptedEngine(tokenizer, lambda e, p: "<answer>Left</answer>"), env_threads=2, call_timeout_s=0.5
    )
    specs = [EpisodeSpec("test/HangSokoban-v0", s, "s", max_turns=3) for s in range(8)]
    results = await asyncio.gather(*(runner.run(spec) for spec in specs))
    failed = {spec.seed for spec, r in zip(specs, results, strict=True) if r.failed}
    assert failed == {0, 4}, [r.error for r in results]
    assert all("timed out after 0.5" in r.error for r in results if r.failed)


async def test_tool_calls_run_concurrently_and_errors_reach_the_model(tokenizer):
    toolbox_cfg = ToolsConfig(sets={"calc": {"calculator": ToolSpec(python="agentrl.tools.calculator:calculator")}})
    from agentrl.tools import build_toolbox, parse_tool_calls

    def script(episode_id, prompt_text):
        if "<tool_response>" not in prompt_text:
            return (
                '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
                '<tool_call>{"name": "calculator", "arguments": {"expression": "1 +"}}</tool_call>'
                "<tool_call>{not json}</tool_call>"
            )
        return "<answer>Up</answer>"

    runner = EpisodeRunner(
        tokenizer,
        ScriptedEngine(tokenizer, script),
        lambda i, k: make_env(i, **k),
        EnvsConfig(),
        ToolsConfig(max_calls_per_turn=4),
        toolboxes={("calc",): build_toolbox(toolbox_cfg, ["calc"])},
        tool_parser=parse_tool_calls,
    )
    ep = await runner.run(_spec(5, tool_sets=["calc"], sampling=SamplingConfig(max_tokens=128)))
    assert ep.error is None and ep.tool_calls == 3
    tool_msgs = [m["content"] for m in ep.messages if m["role"] == "tool"]
    assert len(tool_msgs) == 3 and "42" in tool_msgs[0]
    assert tool_msgs[1].startswith("error") and "parse" in tool_msgs[2]
    assert ep.truncation == "max_turns" and ep.messages[-1]["role"] == "user", "the last board is shown, unread"
    read = ep.messages[:-1]  # the model's last reply ends the tokens
    rendered = tokenizer.apply_chat_template(read, tools=runner.toolboxes[("calc",)].schemas(), tokenize=False)
    assert tokenizer.decode(ep.token_ids) == rendered.removesuffix("\n")


async def test_the_last_turns_tool_results_are_kept_in_the_messages_but_not_the_tokens(tokenizer):
    """An episode that hits its turn limit on a tool call: the tools ran, so the episode log shows what they
    returned (after the model's call), while the trajectory ends with the model's tokens."""
    from agentrl.tools import build_toolbox, parse_tool_calls

    toolbox_cfg = ToolsConfig(sets={"calc": {"calculator": ToolSpec(python="agentrl.tools.calculator:calculator")}})
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
    runner = EpisodeRunner(
        tokenizer,
        ScriptedEngine(tokenizer, lambda episode_id, prompt_text: call),
        lambda i, k: make_env(i, **k),
        EnvsConfig(),
        ToolsConfig(),
        toolboxes={("calc",): build_toolbox(toolbox_cfg, ["calc"])},
        tool_parser=parse_tool_calls,
    )
    spec = EpisodeSpec("agentrl/SimpleSokoban-v0", 5, "sokoban", max_turns=2, tool_sets=["calc"])
    ep = await runner.run(spec)
    assert ep.error is None and ep.truncation == "max_turns" and ep.tool_calls == 2
    assert [m["role"] for m in ep.messages] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert "42" in ep.messages[-1]["content"]
    assert ep.loss_mask[-1] == 1, "the trajectory ends with the model's own tokens"
    read = ep.messages[:-1]
    rendered = tokenizer.apply_chat_template(read, tools=runner.toolboxes[("calc",)].schemas(), tokenize=False)
    assert tokenizer.decode(ep.token_ids) == rendered.removesuffix("\n")


async def test_256_concurrent_episodes_without_loop_stall(tokenizer):
    engine = ScriptedEngine(tokenizer, _expert_script(), delay_s=0.002)
    runner = _runner(tokenizer, engine)
    gaps: list[float] = []
    done = asyncio.Event()

    async def heartbeat():
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    beat = asyncio.ensure_future(heartbeat())
    results = await asyncio.gather(*(runner.run(_spec(1000 + s)) for s in range(256)))
    done.set()
    await beat
    assert all(r.error is None for r in results)
    assert sum(r.metrics["success"] for r in results) == 256
    assert len(gaps) > 10 and max(gaps) < 2.0, f"event loop stalled for {max(gaps):.2f}s"
