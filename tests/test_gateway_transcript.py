"""The gateway's token-exact record (no engine: completions are token lists given here, as an engine returns them):
a call that extends the history reuses its exact tokens, a rewritten history or a retried turn branches, and a
concurrent call never overwrites another's record."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from agentrl.envmanager.chat import ChatTokens
from agentrl.envmanager.samples import to_samples
from agentrl.gateway.agents import AgentEpisodes
from agentrl.gateway.server import Session
from agentrl.gateway.transcript import Transcript, template_message
from agentrl.types import Episode, GenOutput

SYSTEM = {"role": "system", "content": "Push the box onto the target."}
USER = {"role": "user", "content": "#####\n#P X#\n#####"}


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture
def transcript(tok):
    chats: dict[str, ChatTokens] = {}

    def chat_for(tools):
        key = json.dumps(tools or [])
        return chats.setdefault(key, ChatTokens(tok, tools))

    return Transcript(chat_for)


def _odd_tokens(tok, text: str) -> list[int]:
    """`text` as the model might have sampled it: one token per character, which re-tokenising would merge."""
    ids = [i for ch in text for i in tok.encode(ch, add_special_tokens=False)]
    assert ids != tok.encode(text, add_special_tokens=False), "pick a text the tokenizer merges"
    return [*ids, tok.eos_token_id]


def _out(ids: list[int], version: int = 0) -> GenOutput:
    return GenOutput(ids, [-0.5] * len(ids), "stop", version)


def _turn(transcript, tok, messages, text, tools=None):
    prompt = transcript.prompt(messages, tools)
    ids = _odd_tokens(tok, text)
    reply = {"role": "assistant", "content": text}
    transcript.record(prompt, _out(ids), template_message(reply), {tok.eos_token_id})
    return prompt, ids, reply


def test_extending_calls_reuse_the_exact_tokens(transcript, tok):
    p1, ids1, reply1 = _turn(transcript, tok, [SYSTEM, USER], "<answer>Right</answer>")
    assert tok.decode(p1.token_ids) == tok.apply_chat_template(
        [SYSTEM, USER], tokenize=False, add_generation_prompt=True
    )
    # the agent echoes the reply as the SDK gives it back (extra fields, None) and adds the next observation
    echoed = {**reply1, "refusal": None, "tool_calls": None}
    messages2 = [SYSTEM, USER, template_message(echoed), {"role": "user", "content": "#####\n# PX#\n#####"}]
    p2, ids2, _ = _turn(transcript, tok, messages2, "<answer>Right</answer>")
    assert p2.token_ids[: len(p1.token_ids) + len(ids1)] == p1.token_ids + ids1  # the sampled split, kept
    assert p2.reused == len(p1.token_ids) + len(ids1) and not transcript.branches
    # and the rest is what the template writes for the new message
    rendered = tok.apply_chat_template(messages2, tokenize=False, add_generation_prompt=True)
    assert tok.decode(p2.token_ids) == rendered
    main = transcript.main
    assert [t for t, m in zip(main.token_ids, main.loss_mask, strict=True) if m] == ids1 + ids2
    assert main.token_ids == p2.token_ids + ids2
    assert [len(t.prompt_ids) for t in transcript.turns] == [len(p1.token_ids), len(p2.token_ids)]


def test_a_rewritten_history_branches_into_a_new_sample(transcript, tok):
    _, ids1, _reply1 = _turn(transcript, tok, [SYSTEM, USER], "<answer>Up</answer>")
    summary = {"role": "user", "content": "So far: you moved up. Now the box is left of you."}
    p2, ids2, _ = _turn(transcript, tok, [SYSTEM, summary], "<answer>Left</answer>")
    assert p2.line == -1 and len(transcript.branches) == 1  # rendered afresh, not spliced onto the old tokens
    ep = Episode(episode_id="e", group_id="g")
    AgentEpisodes._record(ep, Session("k", "e", None, 8, transcript))  # type: ignore[arg-type]
    samples = to_samples(ep, 1.0, "trajectory")
    assert len(samples) == 2 and {s.episode_id for s in samples} == {"e"}
    assert [t for t, m in zip(samples[0].token_ids, samples[0].loss_mask, strict=True) if m] == ids2
    assert [t for t, m in zip(samples[1].token_ids, samples[1].loss_mask, strict=True) if m] == ids1
    assert ep.messages[-2] == summary and ep.final_answer == "<answer>Left</answer>"
    steps = to_samples(ep, 1.0, "step")  # turn-wise: every call is its own sample, whatever the history did
    assert [s.turn_index for s in steps] == [0, 1]


def test_a_retried_turn_branches_from_the_shared_prefix(transcript, tok):
    p1, ids1, reply1 = _turn(transcript, tok, [SYSTEM, USER], "<answer>Up</answer>")
    obs = {"role": "user", "content": "#####\n#P X#\n#####"}
    messages2 = [SYSTEM, USER, template_message(reply1), obs]
    _turn(transcript, tok, messages2, "<answer>Down</answer>")
    p3, _, _ = _turn(transcript, tok, messages2, "<answer>Right</answer>")  # the agent resamples turn 2
    assert p3.line == 0 and len(transcript.lines) == 2
    branch, main = transcript.branches[0], transcript.main
    shared = len(p1.token_ids) + len(ids1)
    assert main.token_ids[:shared] == branch.token_ids[:shared] == p1.token_ids + ids1


def test_tool_calls_echoed_back_match_what_was_returned(transcript, tok):
    tools = [{"type": "function", "function": {"name": "move", "parameters": {"type": "object"}}}]
    reply = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "move", "arguments": {"d": "up"}}}],
    }
    p1 = transcript.prompt([SYSTEM, USER], tools)
    ids = _odd_tokens(tok, '<tool_call>{"name": "move"}</tool_call>')
    transcript.record(p1, _out(ids), template_message(reply), {tok.eos_token_id})
    # what the openai SDK sends back: arguments as a JSON string, plus fields the gateway ignores
    echoed = {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "move", "arguments": '{"d": "up"}'}}],
    }
    result = {"role": "tool", "tool_call_id": "call_1", "content": "moved"}
    p2 = transcript.prompt([SYSTEM, USER, template_message(echoed), template_message(result)], tools)
    assert p2.line == 0 and p2.token_ids[: len(p1.token_ids) + len(ids)] == p1.token_ids + ids
    assert transcript.prompt([SYSTEM, USER, template_message(echoed)], None).line == -1  # other tools: no reuse


def test_concurrent_calls_from_one_point_never_overwrite_each_other(transcript, tok):
    _, _ids1, reply1 = _turn(transcript, tok, [SYSTEM, USER], "<answer>Up</answer>")
    base = [SYSTEM, USER, template_message(reply1)]
    a = transcript.prompt([*base, {"role": "user", "content": "a"}], None)
    b = transcript.prompt([*base, {"role": "user", "content": "b"}], None)
    ids_a, ids_b = _odd_tokens(tok, "<answer>A</answer>"), _odd_tokens(tok, "<answer>B</answer>")
    transcript.record(a, _out(ids_a, 1), template_message({"role": "assistant", "content": "A"}), {tok.eos_token_id})
    transcript.record(b, _out(ids_b, 2), template_message({"role": "assistant", "content": "B"}), {tok.eos_token_id})
    assert len(transcript.lines) == 2
    first, second = (line.seq for line in transcript.lines)
    assert first.token_ids == a.token_ids + ids_a and second.token_ids == b.token_ids + ids_b
    assert set(second.versions) == {-1, 0, 2} and 1 not in second.versions


def test_openai_content_shapes_render_as_text():
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert template_message(parts) == {"role": "user", "content": "ab"}
    assert template_message({"role": "developer", "content": "rules"}) == {"role": "system", "content": "rules"}
