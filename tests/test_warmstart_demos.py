"""The SFT warm start's expert demos are shaped exactly like the policy's own turns: same prompts (tool schemas
included), tool calls run through the configured tools and their results read back, the same turn-wise window.

The reference is the env manager's real `EpisodeRunner`, driven by a policy that says what the expert says."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import pytest

from agentrl.config.schema import Config
from agentrl.envmanager.chat import ChatTokens
from agentrl.envmanager.episode import EpisodeRunner
from agentrl.envmanager.manager import build_toolboxes
from agentrl.envs import make_env
from agentrl.envs.sokoban import parse_grid, render, solve
from agentrl.run.warm_start import DEMO_SEED_OFFSET, expert_samples
from agentrl.tools.parsers import parse_tool_calls
from agentrl.types import EpisodeSpec, GenOutput

CALCULATOR = {"calculator": {"calculator": {"python": "agentrl.tools.calculator:calculator"}}}


def _math_config(sample_mode: str) -> Config:
    math = {"env_id": "agentrl/MathTool-v0", "tools": ["calculator"], "max_turns": 3}
    return Config.model_validate(
        {
            "tools": {"sets": CALCULATOR},
            "envs": {"train": {"math": math}, "sample_mode": sample_mode, "turn_history_window": 1},
            "rollout": {"sampling": {"max_tokens": 64}},
        }
    )


async def _policy_turns(cfg: Config, tokenizer: Any, seed: int) -> tuple[list[list[int]], list[list[int]], Any]:
    """Prompts and answers of one episode played by the env manager's runner, the policy echoing the expert."""
    made: dict[str, Any] = {}
    chat = ChatTokens(tokenizer)

    def make(env_id: str, kwargs: dict) -> Any:
        made["env"] = make_env(env_id, **kwargs)
        return made["env"]

    async def generate(episode_id: str, ids: list[int], sampling: Any, rid: str) -> GenOutput:
        tokens = [*chat.encode(made["env"].expert_action()), tokenizer.eos_token_id]
        return GenOutput(tokens, [0.0] * len(tokens), "stop", 0)

    spec = cfg.envs.train["math"]
    runner = EpisodeRunner(
        tokenizer,
        generate,
        make,
        cfg.envs,
        cfg.tools,
        toolboxes=build_toolboxes(cfg),
        tool_parser=functools.partial(parse_tool_calls, parser=cfg.tools.parser),
    )
    episode = EpisodeSpec(
        spec.env_id, seed, "math", max_turns=spec.max_turns, tool_sets=spec.tools, sampling=cfg.rollout.sampling
    )
    ep = await runner.run(episode)
    assert ep.error is None, ep.error
    return [t.prompt_ids for t in ep.turns], [t.token_ids for t in ep.turns], ep


@pytest.mark.parametrize("sample_mode", ["trajectory", "turn"])
def test_tool_demos_match_the_policys_own_turns(tiny_model_path: str, sample_mode: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    cfg = _math_config(sample_mode)
    demos = expert_samples(cfg, tokenizer, 3)
    assert demos.failed_episodes == 0
    for i in range(3):
        mine = [s for s in demos if s.episode_id == f"demo/math/{i}"]
        prompts, answers, ep = asyncio.run(_policy_turns(cfg, tokenizer, DEMO_SEED_OFFSET + i))
        assert len(mine) == len(prompts) == 2  # a calculator call, then the answer it read back
        for sample, prompt, answer in zip(mine, prompts, answers, strict=True):
            split = sample.loss_mask.index(1)
            assert sample.token_ids[:split] == prompt  # the very prompt the policy sees at that turn
            assert sample.token_ids[split:] == answer
        assert ep.metrics["success"] == 1.0 and ep.tool_calls == 1
        text = tokenizer.decode(mine[1].token_ids)
        assert "<tool_response>" in text and '"name": "calculator"' in text  # result read back, schema shown
        assert ep.task["ground_truth"] in tokenizer.decode(mine[1].token_ids[mine[1].loss_mask.index(1) :])


def test_expert_noise_demos_show_recoveries_and_never_train_on_the_random_moves(tiny_model_path: str) -> None:
    """With trainer.sft.expert_noise, some demo turns play a random move: none of them is a sample, and the
    samples after one are the expert recovering from where the mistake left it (here: revisited positions)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    sokoban = {"env_id": "agentrl/SimpleSokoban-v0", "kwargs": {"mark_revisits": True}}
    cfg = Config.model_validate({"envs": {"train": {"sokoban": sokoban}, "sample_mode": "turn"}})
    clean = expert_samples(cfg, tokenizer, 40)
    cfg.trainer.sft.expert_noise = 0.3
    noisy = expert_samples(cfg, tokenizer, 40)
    assert noisy.failed_episodes == clean.failed_episodes == 0

    def answers_and_prompts(samples: list) -> tuple[list[str], list[str]]:
        def text(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=True)

        cuts = [s.loss_mask.index(1) for s in samples]
        answers = [text(s.token_ids[c:]) for s, c in zip(samples, cuts, strict=True)]
        return answers, [text(s.token_ids[:c]) for s, c in zip(samples, cuts, strict=True)]

    clean_answers, clean_prompts = answers_and_prompts(clean)
    noisy_answers, noisy_prompts = answers_and_prompts(noisy)
    assert not any("(visit" in p for p in clean_prompts)  # the optimal expert never comes back
    assert sum("(visit" in p for p in noisy_prompts) >= 3  # recoveries from blocked or backward random moves
    for samples in (clean, noisy):  # every trained answer is an optimal move from its prompt's grid
        for sample, answer, prompt in zip(samples, *answers_and_prompts(samples), strict=True):
            state = parse_grid(prompt.split("user\n")[-1])
            env = make_env("agentrl/Sokoban-v0")
            env.reset(options={"grid": render(state)})
            env.step(answer)
            assert len(solve(env.state)) == len(solve(state)) - 1, (sample.episode_id, prompt, answer)
    assert expert_samples(cfg, tokenizer, 40) == noisy  # seeded: the same demos every time
    assert clean_answers != noisy_answers
