"""Agent programs played by the SFT warm start: the agent's own code (the plain openai SDK one, and the pydantic-ai
one) against a gateway where the env's expert answers in the model's place. No engine: the expert is the model."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from agentrl.config import ConfigError, load_config
from agentrl.gateway.demos import AgentDemos

pytestmark = pytest.mark.asyncio(loop_scope="session")
MOVE_CALL = '<tool_call>{"name": "move", "arguments": {"direction": "'


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


async def _demos(tok, agent: str, noise: float = 0.0, episodes: int = 4, answers: list | None = None):
    cfg = load_config(None, [f"trainer.sft.expert_noise={noise}", "rollout.sampling.max_tokens=28"])
    cfg.envs.train = {"sokoban": {"env_id": "agentrl/SimpleSokoban-v0", "agent": agent}}
    demos = AgentDemos(cfg, tok, {}, noise_seed=7)
    expert = demos._generate

    async def kept(*args):  # every answer the expert gave, noisy or not
        out = await expert(*args)
        (answers if answers is not None else []).append(out)
        return out

    demos.gateway.generate = kept
    await demos.start()
    try:
        spec = cfg.envs.train["sokoban"]
        return [await demos.play("sokoban", spec, 100 + i, i) for i in range(episodes)]
    finally:
        await demos.aclose()


@pytest.mark.parametrize("agent", ["sokoban_openai_agent", "sokoban_pydantic_ai_agent"])
async def test_the_expert_plays_the_agents_own_code(tok, agent):
    played = await _demos(tok, f"agentrl.examples.{agent}:agent")
    assert all(played), "every demo episode gives samples"
    for samples in played:
        for s in samples:
            said = tok.decode([t for t, m in zip(s.token_ids, s.loss_mask, strict=True) if m])
            assert said.startswith(MOVE_CALL) and said.endswith("</tool_call><|im_end|>")
            prompt = tok.decode(s.token_ids[: s.loss_mask.index(1)])
            assert '"name": "move"' in prompt and "Make one move per turn with the move tool." in prompt
    if agent == "sokoban_pydantic_ai_agent":  # the framework sends each tool result back as a tool message
        assert any("<tool_response>" in tok.decode(s.token_ids) for samples in played for s in samples)


async def test_noisy_demo_moves_are_played_not_trained(tok):
    answers: list = []
    noisy = await _demos(tok, "agentrl.examples.sokoban_openai_agent:agent", noise=0.5, episodes=6, answers=answers)
    random_moves = sum(1 for out in answers if out.versions[0] == -2)
    assert 0 < random_moves < len(answers)
    assert sum(len(samples) for samples in noisy) == len(answers) - random_moves  # one sample per expert move
    assert all(v == -1 for samples in noisy for s in samples for v in s.versions)


async def test_an_agent_without_an_expert_reply_is_a_clear_error(tok):
    with pytest.raises(ConfigError, match="no expert_reply"):
        await _demos(tok, "tests.agents_fixtures:scored", episodes=1)
