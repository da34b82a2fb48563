"""ChatTokens remembers encoded texts (step-wise prompts repeat): a remembered text gives the tokenizer's own ids,
a caller changing its list cannot change what the next caller gets, and the memory stays bounded."""

from __future__ import annotations

import pytest

from agentrl.envmanager import chat
from agentrl.envmanager.chat import ChatTokens
from agentrl.envs import make_env


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def test_remembered_prompts_equal_the_tokenizers_ids_and_stay_bounded(tokenizer, monkeypatch) -> None:
    monkeypatch.setattr(chat, "_ENCODED_TEXTS", 8)
    ct = ChatTokens(tokenizer)
    env = make_env("agentrl/SimpleSokoban-v0")
    prompts = []
    for seed in range(6):
        obs, _ = env.reset(seed=seed)
        prompts.append([{"role": "user", "content": obs}])
    for _ in range(3):  # the second and third rounds are served from memory
        for messages in prompts:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            want = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            got = ct.prompt_ids(messages)
            assert got == want
            got.append(-1)  # the caller owns its list: the remembered ids stay as they were
    assert 0 < len(ct._encoded) <= 8
    for i in range(20):
        ct.encode(f"text {i}")
    assert len(ct._encoded) <= 8
