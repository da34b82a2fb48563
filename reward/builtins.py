"""Built-in rule-based rewards: answer matching (exact, numeric, math-verify), format checks, DAPO overlong.

Each is registered by name (see `agentrl.reward.registered()`); kwargs come from `reward.functions[].kwargs`.
The answer is read from the episode's final answer: the last `<answer>...</answer>`, else the last
`\\boxed{...}`, else (for math_verify) the whole text. The ground truth comes from `episode.task`
(`ground_truth`, or `answer`) unless a `ground_truth` kwarg overrides it.
"""

from __future__ import annotations

import logging
import math
import re
import string
from typing import Any

from agentrl.reward.registry import register
from agentrl.reward.types import FnOutput
from agentrl.types import Episode

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_FRAC = re.compile(r"^\s*(-?)\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}\s*$")

logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every call that we time it out ourselves


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, with nested braces balanced; None if there is none (or unclosed)."""
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i].strip()
    return None


def extract_answer(text: str | None) -> str | None:
    """The answer in model output: last <answer> tag, else last \\boxed{}; None when neither is present."""
    if not text:
        return None
    tags = _ANSWER_TAG.findall(text)
    if tags:
        inner = tags[-1].strip()
        return last_boxed(inner) or inner
    return last_boxed(text)


def normalise_text(text: str) -> str:
    """SQuAD-style: lower case, no punctuation, no articles, single spaces."""
    text = text.lower().strip()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def parse_number(text: str | None) -> float | None:
    """A plain number, '1,234', '$5', '40%', 'a/b' or \\frac{a}{b}; None when the text is not one number."""
    if text is None:
        return None
    s = text.strip().strip("$").replace("\\!", "").replace(",", "").replace("\\%", "").rstrip("%").strip()
    s = s.removeprefix("\\$").strip()
    frac = _FRAC.match(s)
    if frac:
        s = f"{frac.group(1)}{frac.group(2)}/{frac.group(3)}"
    if "/" in s:
        num, _, den = s.partition("/")
        a, b = parse_number(num), parse_number(den)
        return None if a is None or b is None or b == 0 else a / b
    return float(s) if _NUMBER.fullmatch(s) else None


def _truths(episode: Episode, ground_truth: Any) -> list[str]:
    truth = episode.ground_truth if ground_truth is None else ground_truth
    if truth is None:
        raise ValueError("no ground truth: set task['ground_truth'] or the ground_truth kwarg")
    return [str(t) for t in truth] if isinstance(truth, (list, tuple)) else [str(truth)]


@register("exact_match")
def exact_match(episode: Episode, ground_truth: Any = None, normalize: bool = True) -> float:
    """1 if the extracted answer equals a ground truth (after `normalise_text` unless normalize=False)."""
    answer = extract_answer(episode.final_answer)
    if answer is None:
        return 0.0
    norm = normalise_text if normalize else str.strip
    return float(any(norm(answer) == norm(t) for t in _truths(episode, ground_truth)))


@register("numeric_match")
def numeric_match(episode: Episode, ground_truth: Any = None, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> float:
    """1 if the extracted answer is a number within tolerance of a ground truth."""
    value = parse_number(extract_answer(episode.final_answer))
    if value is None:
        return 0.0
    truths = [parse_number(t) for t in _truths(episode, ground_truth)]
    return float(any(t is not None and math.isclose(value, t, rel_tol=rel_tol, abs_tol=abs_tol) for t in truths))


@register("math_verify")
def math_verify_reward(episode: Episode, ground_truth: Any = None, require_format: bool = False) -> float:
    """1 if math-verify finds the answer equivalent to the ground truth (LaTeX or plain; \\boxed{} or tags).

    math-verify's own timeouts use SIGALRM (main thread only), so they are off here: the pool's per-call
    timeout bounds it, and `isolation: process` kills a runaway parse.
    """
    from math_verify import parse, verify

    text = episode.final_answer or ""
    answer = extract_answer(text)
    if answer is None and require_format:
        return 0.0
    pred = parse(f"${answer}$" if answer is not None else text, parsing_timeout=None)
    if not pred:
        return 0.0
    for truth in _truths(episode, ground_truth):
        gold = parse(truth if "$" in truth or "\\boxed" in truth else f"${truth}$", parsing_timeout=None)
        if gold and verify(gold, pred, timeout_seconds=None):
            return 1.0
    return 0.0


@register("answer_format")
def answer_format(episode: Episode, style: str = "either") -> float:
    """1 if the final answer carries the expected wrapper: style 'tag' (<answer>), 'boxed', or 'either'."""
    text = episode.final_answer or ""
    tag = bool(_ANSWER_TAG.search(text)) and bool(_ANSWER_TAG.findall(text)[-1].strip())
    boxed = bool(last_boxed(text))
    if style not in ("tag", "boxed", "either"):
        raise ValueError(f"answer_format style must be tag, boxed or either, got {style!r}")
    return float({"tag": tag, "boxed": boxed, "either": tag or boxed}[style])


@register("tool_call_format")
def tool_call_format(
    episode: Episode, tools: list[str] | None = None, parser: str = "hermes", required: bool = False
) -> FnOutput:
    """Fraction of the assistant's tool calls that parse (valid JSON, a name, object arguments) and name a
    known tool (when `tools` is given). No calls at all scores 0 if `required`, else 1."""
    from agentrl.tools import ToolCall, parse_tool_calls

    calls = [
        c
        for m in episode.messages
        if m.get("role") == "assistant"
        for c in parse_tool_calls(str(m.get("content") or ""), parser)
    ]
    good = sum(1 for c in calls if isinstance(c, ToolCall) and (tools is None or c.name in tools))
    score = good / len(calls) if calls else float(not required)
    return FnOutput(score, {"calls": float(len(calls)), "invalid": float(len(calls) - good)})


@register("overlong_penalty")
def overlong_penalty(episode: Episode, max_tokens: int | None = None, buffer: int = 256) -> float:
    """DAPO's soft overlong punishment: 0 up to max - buffer tokens, then linear down to -1 at max, -1 beyond.

    `max_tokens` defaults to the episode's `max_model_tokens`.
    """
    limit = int(max_tokens if max_tokens is not None else episode.max_model_tokens)
    if limit <= 0:
        raise ValueError("overlong_penalty needs max_tokens (kwarg) or episode.max_model_tokens")
    buffer = max(0, min(int(buffer), limit))
    length = episode.num_model_tokens
    if length <= limit - buffer:
        return 0.0
    if length > limit or buffer == 0:
        return -1.0
    return (limit - buffer - length) / buffer
