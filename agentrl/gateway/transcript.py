"""The token-exact record of one gateway episode: every chat-completions call is one model turn.

An agent sends its whole conversation with every call. Re-tokenising it each time would drift from the tokens the
model actually produced (a known failure of gateways: verl #6719 / #3960, TRL #6250), so the transcript keeps the
episode's token history in segments and reuses it:

- a call whose messages extend a recorded point (the messages up to and including an assistant reply the gateway
  returned, as the agent echoes it back) continues from that point's exact tokens: the new messages are appended
  as chat-template deltas (`ChatTokens.delta_ids`), as the env manager does for native episodes;
- the recorded point is a segment's end: the segment grows in place (one trajectory-wise sample);
- an earlier point (the agent retried a turn, or dropped its last turns): a new segment that copies the segment's
  tokens up to there and branches;
- no recorded point (the first call, an edited or summarised history, other tools): a new segment rendered by the
  chat template.

So a rewritten history never gets a silently wrong mask: it starts a new sample (trajectory-wise), and turn-wise
every call is a sample of its own anyway (its prompt, however it was built, and its completion).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentrl.envmanager.chat import ChatTokens
from agentrl.types import GenOutput, Segment, Turn

Message = dict[str, Any]


def template_message(message: Message) -> Message:
    """An OpenAI chat message as chat templates read it (and as the transcript compares messages): text parts
    joined, tool-call arguments as objects, SDK-only fields (refusal, audio, annotations, ...) dropped."""
    role = message["role"]
    out: Message = {"role": "system" if role == "developer" else role, "content": content_text(message.get("content"))}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": call.get("id"),
                "type": "function",
                "function": {
                    "name": call["function"]["name"],
                    "arguments": _arguments(call["function"].get("arguments")),
                },
            }
            for call in message["tool_calls"]
        ]
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def content_text(content: Any) -> str:
    """A message's content as one string: OpenAI allows a string, None (an assistant that only calls tools) or a
    list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            return raw  # kept as the model wrote it: the template shows it, the comparison sees it
    return raw if raw is not None else {}


@dataclass
class _Point:
    """A place a call can continue from: the end of an assistant reply in a segment."""

    messages: int  # messages up to and including the reply
    tokens: int  # the segment's tokens up to and including the reply's last token
    ended_with_eos: bool


@dataclass
class _Line:
    """A segment as it grows: its tokens, the messages they render, and the points after each reply."""

    tools_key: str
    seq: Segment = field(default_factory=Segment)
    messages: list[Message] = field(default_factory=list)
    points: list[_Point] = field(default_factory=list)


@dataclass
class Prompt:
    """What one call sends to the engine, and where its reply will be recorded."""

    token_ids: list[int]
    messages: list[Message]  # the call's messages, as templates read them
    line: int  # the segment it continues (-1: a new one)
    base: int  # tokens of that segment it starts from (its own tokens follow)
    tools_key: str
    chat: ChatTokens  # the chat template state of its tools (the reply is read with it too)

    @property
    def reused(self) -> int:
        """Prompt tokens taken from the record rather than rendered for this call."""
        return self.base


class Transcript:
    """One gateway episode's segments and turns. `chat_for(tools)` gives the episode's `ChatTokens` for a tool
    list (shared across episodes by the gateway)."""

    def __init__(self, chat_for: Callable[[list[dict] | None], ChatTokens]):
        self.chat_for = chat_for
        self.lines: list[_Line] = []
        self.turns: list[Turn] = []
        self.last_line = -1  # the segment the latest reply went to: the episode's main line

    def prompt(self, messages: list[Message], tools: list[dict] | None) -> Prompt:
        """The engine prompt for a call with `messages` (as templates read them) and `tools`."""
        key = json.dumps(tools or [], sort_keys=True)
        chat = self.chat_for(tools)
        best: tuple[int, _Point] | None = None
        for i, line in enumerate(self.lines):
            if line.tools_key != key:
                continue
            for point in line.points:
                longer = point.messages < len(messages) and (best is None or point.messages > best[1].messages)
                if longer and line.messages[: point.messages] == messages[: point.messages]:
                    best = (i, point)
        if best is None:
            return Prompt(chat.prompt_ids(messages), messages, -1, 0, key, chat)
        i, point = best
        delta = chat.delta_ids(messages[point.messages :], point.ended_with_eos)
        ids = self.lines[i].seq.token_ids[: point.tokens] + delta
        return Prompt(ids, messages, i, point.tokens, key, chat)

    def record(self, prompt: Prompt, out: GenOutput, reply: Message, eos_ids: set[int]) -> Turn:
        """Record the engine's output for `prompt` and the assistant message the agent got (`reply`, as templates
        read it). A segment that grew meanwhile (a concurrent call) is branched, never overwritten."""
        if prompt.line >= 0 and len(self.lines[prompt.line].seq.token_ids) == prompt.base:
            line = self.lines[prompt.line]
            self.last_line = prompt.line
        else:
            line = _Line(prompt.tools_key)
            if prompt.line >= 0:  # copy the shared prefix, exact tokens and all
                line.seq = self.lines[prompt.line].seq.prefix(prompt.base)
            self.lines.append(line)
            self.last_line = len(self.lines) - 1
        line.seq.append(prompt.token_ids[len(line.seq.token_ids) :], model=False)
        line.seq.append(out.token_ids, model=True, logprobs=out.logprobs, versions=out.versions)
        line.messages = [*prompt.messages, reply]
        ended = bool(out.token_ids) and out.token_ids[-1] in eos_ids
        line.points.append(_Point(len(line.messages), len(line.seq.token_ids), ended))
        turn = Turn(prompt.token_ids, list(out.token_ids), list(out.logprobs), list(out.versions), resumes=out.resumes)
        self.turns.append(turn)
        return turn

    @property
    def main(self) -> Segment:
        """The segment the latest reply went to (empty before the first)."""
        return self.lines[self.last_line].seq if self.lines else Segment()

    @property
    def branches(self) -> list[Segment]:
        """Every other segment: histories the agent rewrote or turns it retried, each a sample of its own."""
        return [line.seq for i, line in enumerate(self.lines) if i != self.last_line]

    @property
    def messages(self) -> list[Message]:
        """The main line's conversation, the last reply included (what reward functions read)."""
        return list(self.lines[self.last_line].messages) if self.lines else []
