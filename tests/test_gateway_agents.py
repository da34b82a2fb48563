"""Agent programs played by the SFT warm start: the agent's own code (the plain openai SDK one, and the pydantic-ai
one) against a gateway where the env's expert answers in the model's place. No engine: the expert is the model."""

from __future__ import annotations

import json

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


@pytest.fixture
async def command_episodes(tok):
    """Agent commands against a gateway whose engine is the env's expert (no model needed)."""
    cfg = load_config(None, ["rollout.sampling.max_tokens=28"])
    demos = AgentDemos(cfg, tok, {}, noise_seed=7)
    await demos.start()
    demos.episodes.timeout_s = 20.0

    async def run(argv: str, seed: int = 0):
        from agentrl.types import EpisodeSpec

        agent = f"cmd: python tests/agent_command.py {argv}"
        spec = EpisodeSpec("agentrl/SimpleSokoban-v0", seed, "cmd", "demo", 0, agent=agent,
                           sampling=cfg.rollout.sampling)  # fmt: skip
        demos._play[spec.episode_id] = (lambda action: action, __import__("random").Random(0))
        return await demos.episodes.run(spec, agent)

    yield run, demos
    await demos.aclose()


@pytest.mark.heavy
async def test_an_agent_command_plays_through_the_gateway_in_a_jail(command_episodes, tok, tmp_path):
    run, demos = command_episodes
    ep = await run("play")
    assert ep.error is None, ep.error
    (turn,) = ep.turns  # its one model call, recorded token-exact
    assert tok.decode(turn.token_ids).startswith("<answer>") and ep.metrics["steps"] == 1.0
    assert ep.env_return == pytest.approx(0.5 + turn.reward)  # its printed reward: 0.5 + what its step got
    secret = tmp_path / "secret"
    secret.write_text("host file")
    # its gateway's own TCP address, another address, the internet, a host file: all out of reach (it exits 5 if not)
    escape = await run(f"escape {demos.gateway.url}/health http://10.255.255.1:80/ https://pypi.org/ {secret}")
    assert escape.error is None, escape.error


@pytest.mark.heavy
async def test_agent_commands_that_fail_or_hang_fail_their_episode(command_episodes):
    run, demos = command_episodes
    failed = await run("fail")
    assert failed.error is not None and "exited with code 3" in failed.error and "went wrong" in failed.error
    demos.episodes.timeout_s = 3.0
    hung = await run("hang")
    assert hung.error is not None and "timed out after 3.0s" in hung.error


async def test_a_hanging_env_fails_the_agents_episode_at_the_step_timeout(tok):
    import time

    import tests.envs_fixtures  # noqa: F401  (registers tests/Hanging-v0)

    cfg = load_config(None, ["envs.call_timeout_s=0.5"])
    cfg.envs.train = {"hang": {"env_id": "tests/Hanging-v0", "agent": "tests.agents_fixtures:plain"}}
    demos = AgentDemos(cfg, tok, {}, noise_seed=7)
    await demos.start()
    try:
        spec = cfg.envs.train["hang"]
        assert (await demos.episode("hang", spec, 1, 0)).metrics["success"] == 1.0  # seed 1 does not hang
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError, match=r"timed out after 0.5s \(envs.call_timeout_s\)"):
            await demos.episode("hang", spec, 3, 1)  # seed 3 hangs 30 s in step
        assert time.perf_counter() - t0 < 10
    finally:
        await demos.aclose()


@pytest.mark.parametrize("source", ["path", "generator"])
async def test_tasks_from_a_dataset_file_or_a_generator(tok, tmp_path, source):
    from agentrl.envs.checker import check_text_env

    rows = [{"prompt": f"What is {i} + {i}?", "answer": 2 * i, "id": f"q{i}"} for i in range(5)]
    data = tmp_path / "tasks.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    kwargs = {"path": str(data)} if source == "path" else {"generator": "tests.agents_fixtures:count_task"}
    cfg = load_config(None, [])
    cfg.envs.train = {"qa": {"env_id": "agentrl/Tasks-v0", "agent": "tests.agents_fixtures:plain", "kwargs": kwargs}}
    demos = AgentDemos(cfg, tok, {}, noise_seed=7)
    await demos.start()
    try:
        ep = await demos.episode("qa", cfg.envs.train["qa"], 7, 0)
    finally:
        await demos.aclose()
    expected = rows[7 % 5] if source == "path" else {"prompt": "What is 7 + 7?", "answer": 14, "seed": 7}
    assert ep.task == expected and ep.messages[1]["content"] == expected["prompt"]
    assert ep.metrics["success"] == 1.0 and ep.final_answer == f"<answer>{expected['answer']}</answer>"
    report = check_text_env("agentrl/Tasks-v0", kwargs, episodes=5, seed=0, timeout_s=10)
    assert report["ok"] and report["expert"]["success_rate"] == 1.0, report["violations"]
