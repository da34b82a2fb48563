"""Tool-call parsers: model text -> tool calls, pluggable by name (`get_parser("hermes")`).

A malformed call becomes a `ParseError` entry rather than an exception, so the env manager can tell the model
what was wrong instead of silently dropping the turn.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    """One well-formed call: a tool name and its JSON-object arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass
class ParseError:
    """A call the model tried to make but got wrong; `message` is meant to be shown to the model."""

    message: str
    raw: str = ""


Parser = Callable[[str], list[ToolCall | ParseError]]
_PARSERS: dict[str, Parser] = {}
_CALL_TEXT: dict[str, re.Pattern] = {}  # parser -> the pattern of its calls' text (to show the rest as content)

_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


def register_parser(name: str, call_text: re.Pattern | None = None) -> Callable[[Parser], Parser]:
    """Decorator: make a parser available to `ToolsConfig.parser` by name. `call_text` matches the text of one
    call, so that what the model said around its calls can be shown apart (the agent gateway's `content`)."""

    def wrap(fn: Parser) -> Parser:
        _PARSERS[name] = fn
        if call_text is not None:
            _CALL_TEXT[name] = call_text
        return fn

    return wrap


def get_parser(name: str) -> Parser:
    try:
        return _PARSERS[name]
    except KeyError:
        raise KeyError(f"unknown tool-call parser {name!r}; registered: {', '.join(sorted(_PARSERS))}") from None


def _short(raw: str, n: int = 80) -> str:
    raw = raw.strip()
    return raw if len(raw) <= n else raw[:n] + "..."


@register_parser("hermes", call_text=_HERMES)
def parse_hermes(text: str) -> list[ToolCall | ParseError]:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, in order (Hermes / Qwen format).

    An unclosed last block (generation stopped mid-call) is still parsed; `arguments` may be a JSON string
    holding an object, as some models emit it that way.
    """
    calls: list[ToolCall | ParseError] = []
    for m in _HERMES.finditer(text):
        raw = m.group(1)
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as err:
            calls.append(ParseError(f"tool call is not valid JSON ({err.msg} at char {err.pos}): {_short(raw)}", raw))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            calls.append(ParseError('tool call must be a JSON object with a string "name"', raw))
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                calls.append(ParseError(f'"arguments" of {obj["name"]} is a string but not JSON', raw))
                continue
        if args is None:
            args = {}
        if not isinstance(args, dict):
            calls.append(ParseError(f'"arguments" of {obj["name"]} must be a JSON object', raw))
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls


def parse_tool_calls(text: str, parser: str = "hermes") -> list[ToolCall | ParseError]:
    """Parse with the named parser (hermes by default)."""
    return get_parser(parser)(text)


def text_without_calls(text: str, parser: str = "hermes") -> str:
    """The model's text with its tool calls cut out (unchanged for a parser that registered no `call_text`)."""
    get_parser(parser)
    pattern = _CALL_TEXT.get(parser)
    return pattern.sub("", text).strip() if pattern is not None else text
