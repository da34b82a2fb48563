"""The project's own tiny model: deterministic build, HF-loadable, compact tokenisation of env text."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

from agentrl.models.tiny import TinySpec, build_tiny_model, resolve_model_path

SMALL = TinySpec(layers=1, hidden=64, intermediate=128, heads=2, kv_heads=1, vocab=512, seed=3)


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), SMALL)


def test_build_is_deterministic(built, tmp_path):
    again = build_tiny_model(tmp_path / "again", SMALL)
    assert _digest(built / "model.safetensors") == _digest(again / "model.safetensors")
    assert _digest(built / "tokenizer.json") == _digest(again / "tokenizer.json")
    other = build_tiny_model(tmp_path / "other", TinySpec(**{**SMALL.__dict__, "seed": 4}))
    assert _digest(other / "model.safetensors") != _digest(built / "model.safetensors")


def test_loads_with_transformers_and_tokenises_compactly(built):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    model = AutoModelForCausalLM.from_pretrained(built)
    assert model.config.model_type == "qwen3" and model.dtype == torch.float32
    assert model.config.vocab_size >= len(tok) and model.config.eos_token_id == tok.eos_token_id
    grid = "######\n#_OX_#\n#P√S_#\n######"
    ids = tok(grid)["input_ids"]
    # one token per cell and per newline: cells never merge
    assert len(ids) == len(grid), [tok.decode([i]) for i in ids]
    for tag in ("<answer>", "</answer>", "<tool_call>", "</tool_call>", "<|im_end|>"):
        assert len(tok(tag)["input_ids"]) == 1, tag
    assert tok.decode(tok("<answer>Up</answer>")["input_ids"], skip_special_tokens=True) == "<answer>Up</answer>"
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size)


def test_chat_template_round_trips(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    messages = [
        {"role": "system", "content": "Solve it."},
        {"role": "user", "content": "#P_#"},
        {"role": "assistant", "content": "<answer>Right</answer>"},
        {"role": "tool", "content": '{"result": 3}'},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text.startswith("<|im_start|>system\nSolve it.<|im_end|>\n<|im_start|>user\n#P_#<|im_end|>\n")
    assert '<tool_response>\n{"result": 3}\n</tool_response>' in text
    assert tok.decode(tok(text)["input_ids"]) == text
    for role in ("system", "user", "assistant"):  # role headers are one token each (every prompt repeats them)
        assert len(tok(f"<|im_start|>{role}\n")["input_ids"]) == 3, role
    prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    with_tools = tok.apply_chat_template(messages[:2], tools=tools, tokenize=False)
    assert "<tools>" in with_tools and '"calculator"' in with_tools


def test_builtin_path_builds_once_into_cache(tmp_path):
    path = resolve_model_path("builtin:tiny", cache_dir=str(tmp_path))
    assert resolve_model_path("builtin:tiny", cache_dir=str(tmp_path)) == path
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 1
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)  # a local folder: as is
    with pytest.raises(ValueError, match="neither a local folder nor a hub id"):  # ConfigError is a ValueError
        resolve_model_path("/some/hf/dir")
    with pytest.raises(ValueError, match="unknown builtin model"):
        resolve_model_path("builtin:huge", cache_dir=str(tmp_path))


@pytest.mark.heavy
def test_make_model_cli(tmp_path):
    out = tmp_path / "m"
    res = subprocess.run(
        [sys.executable, "-m", "agentrl", "make-model", "tiny", str(out), "--layers", "1", "--hidden", "64",
         "--heads", "2", "--kv-heads", "1", "--vocab", "512"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
