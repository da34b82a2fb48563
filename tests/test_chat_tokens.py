"""ChatTokens remembers encoded texts (turn-wise prompts repeat): a remembered text gives the tokenizer's own ids,
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


def test_prompts_encode_piece_by_piece_between_added_tokens(tokenizer) -> None:
    """A turn-wise prompt is the same rules and a new grid: the text between two added tokens (<|im_start|>, ...)
    is encoded once and reused, and the ids still equal the tokenizer's own for every prompt, past the spot
    checks against whole-text encodes."""
    ct = ChatTokens(tokenizer)
    assert ct._cut_at_added is not None
    env = make_env("agentrl/SimpleSokoban-v0", mark_revisits=True)
    rules = "Push the box onto the target. Answer <answer>Up</answer>, Down, Left or Right."
    for seed in range(12):
        obs, _ = env.reset(seed=seed)
        messages = [{"role": "system", "content": rules}, {"role": "user", "content": obs}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ct.prompt_ids(messages) == list(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert ct._cut_at_added is not None  # the spot checks agreed
    system_pieces = [p for p in ct._pieces if rules.split()[0] in p]
    assert len(system_pieces) == 1  # the rules' piece was encoded once for all 12 prompts


def test_a_tokenizer_that_strips_around_added_tokens_encodes_whole_texts(tokenizer) -> None:
    """An added token with lstrip/rstrip eats the spaces beside it: cutting the text there would change the ids,
    so such tokenizers keep encoding whole texts."""
    from copy import deepcopy

    from tokenizers import AddedToken

    tok = deepcopy(tokenizer)
    tok.add_tokens([AddedToken("<obs>", lstrip=True, rstrip=True)])
    ct = ChatTokens(tok)
    assert ct._cut_at_added is None
    text = "a  <obs>  b"
    assert ct.encode(text) == list(tok(text, add_special_tokens=False)["input_ids"])


def _template_ids(tok, messages: list[dict]) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def test_whole_prompts_and_deltas_are_spliced_into_the_templates_fixed_text(tokenizer, monkeypatch) -> None:
    """After its first spot checks, a turn-wise prompt (rules + grid) and a delta (the next user turn) are the
    template's fixed text with the contents spliced in: equal to a real render, without rendering per turn."""
    ct = ChatTokens(tokenizer)
    env = make_env("agentrl/SimpleSokoban-v0", mark_revisits=True)
    rules = env.system_prompt()
    observations = [env.reset(seed=seed)[0] for seed in range(12)]
    for obs in observations[:6]:
        messages = [{"role": "system", "content": rules}, {"role": "user", "content": obs}]
        assert ct.prompt_ids(messages) == _template_ids(tokenizer, messages)
        said = "<answer>Up</answer>"  # the model's turn, without its end-of-turn token
        delta = ct.delta_ids([{"role": "user", "content": obs}], model_ended_with_eos=False)
        prefix = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + said
        history = [*messages, {"role": "assistant", "content": said}, {"role": "user", "content": obs}]
        whole = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        assert delta == list(tokenizer(whole[len(prefix) :], add_special_tokens=False)["input_ids"])
    assert ct._splices[(True, "system", "user")] is not None and ct._splices[(False, "user")] is not None
    expected = {
        obs: _template_ids(tokenizer, [{"role": "system", "content": rules}, {"role": "user", "content": obs}])
        for obs in observations[6:]
    }

    def no_render(*args, **kwargs):
        raise AssertionError("rendered the template for a spliced prompt")

    monkeypatch.setattr(tokenizer, "apply_chat_template", no_render)
    for obs in observations[6:]:
        messages = [{"role": "system", "content": rules}, {"role": "user", "content": obs}]
        assert ct.prompt_ids(messages) == expected[obs]


def test_a_template_that_trims_contents_renders_every_prompt(tokenizer) -> None:
    """Splicing would keep the spaces this template strips: it is detected up front and the template renders."""
    from copy import deepcopy

    tok = deepcopy(tokenizer)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    ct = ChatTokens(tok)
    messages = [{"role": "system", "content": "  rules  "}, {"role": "user", "content": "\n#### \n"}]
    assert ct.prompt_ids(messages) == _template_ids(tok, messages)
    assert ct._splices[(True, "system", "user")] is None
