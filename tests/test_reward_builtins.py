"""Built-in rewards against hand-made cases: LaTeX and plain answers, wrong formats, the overlong penalty."""

from __future__ import annotations

import pytest

from agentrl.reward import Episode, FnOutput, UnknownRewardError, register, registered, resolve
from agentrl.reward.builtins import (
    answer_format,
    exact_match,
    extract_answer,
    last_boxed,
    math_verify_reward,
    numeric_match,
    overlong_penalty,
    parse_number,
    tool_call_format,
)
from agentrl.reward.registry import normalise


def ep(answer: str | None, truth: object = None, **kw: object) -> Episode:
    return Episode(final_answer=answer, task={} if truth is None else {"ground_truth": truth}, **kw)


def test_extract_answer_prefers_last_tag_then_boxed() -> None:
    assert extract_answer("<answer>1</answer> then <answer> 42 </answer>") == "42"
    assert extract_answer(r"so \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert extract_answer(r"<answer>\boxed{7}</answer>") == "7"
    assert extract_answer("no answer here") is None and extract_answer(None) is None
    assert last_boxed(r"\boxed{unclosed") is None
    assert last_boxed(r"\boxed{a} and \boxed{{b}}") == "{b}"


@pytest.mark.parametrize(
    ("text", "value"),
    [("42", 42.0), ("-3.5", -3.5), ("1,234", 1234.0), ("$5", 5.0), ("40%", 40.0), ("3/4", 0.75),
     (r"\frac{1}{4}", 0.25), ("1e3", 1000.0), ("abc", None), ("1/0", None), ("", None)],
)  # fmt: skip
def test_parse_number(text: str, value: float | None) -> None:
    assert parse_number(text) == value


def test_exact_match_normalises() -> None:
    assert exact_match(ep("<answer>The Eiffel Tower.</answer>", "eiffel tower")) == 1.0
    assert exact_match(ep("<answer>The Eiffel Tower.</answer>", "eiffel tower"), normalize=False) == 0.0
    assert exact_match(ep("<answer>Paris</answer>", ["London", "paris"])) == 1.0
    assert exact_match(ep("Paris", "Paris")) == 0.0  # no answer wrapper: wrong format
    assert exact_match(ep("<answer>Paris</answer>"), ground_truth="Paris") == 1.0
    with pytest.raises(ValueError, match="no ground truth"):
        exact_match(ep("<answer>Paris</answer>"))


def test_numeric_match_with_tolerance() -> None:
    assert numeric_match(ep("<answer>3.14159</answer>", "3.14159")) == 1.0
    assert numeric_match(ep("<answer>3.14</answer>", "3.14159")) == 0.0
    assert numeric_match(ep("<answer>3.14</answer>", "3.14159"), rel_tol=1e-3) == 1.0
    assert numeric_match(ep(r"thus \boxed{1,200}", 1200)) == 1.0
    assert numeric_match(ep(r"\boxed{\frac{3}{4}}", "0.75")) == 1.0
    assert numeric_match(ep("<answer>twelve</answer>", "12")) == 0.0
    assert numeric_match(ep("12", "12")) == 0.0  # plain text, no wrapper


@pytest.mark.parametrize(
    ("answer", "truth", "score"),
    [
        (r"The answer is \boxed{\frac{1}{2}}.", "0.5", 1.0),
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        ("<answer>42</answer>", "42", 1.0),
        ("<answer>42.0</answer>", "42", 1.0),
        (r"<answer>\sqrt{4}</answer>", "2", 1.0),
        (r"\boxed{2x+2}", "2(x+1)", 1.0),
        ("so it is 17", "17", 1.0),  # plain text: math-verify finds the number
        (r"\boxed{41}", "42", 0.0),
        ("<answer>forty-two</answer>", "42", 0.0),
        ("", "42", 0.0),
    ],
)
def test_math_verify_latex_and_plain(answer: str, truth: str, score: float) -> None:
    assert math_verify_reward(ep(answer, truth)) == score


def test_math_verify_require_format() -> None:
    assert math_verify_reward(ep("so it is 17", "17"), require_format=True) == 0.0
    assert math_verify_reward(ep(r"\boxed{17}", "17"), require_format=True) == 1.0


def test_answer_format_styles() -> None:
    tag, boxed, neither = ep("<answer>3</answer>"), ep(r"\boxed{3}"), ep("3")
    assert [answer_format(e) for e in (tag, boxed, neither)] == [1.0, 1.0, 0.0]
    assert [answer_format(e, style="tag") for e in (tag, boxed)] == [1.0, 0.0]
    assert [answer_format(e, style="boxed") for e in (tag, boxed)] == [0.0, 1.0]
    assert answer_format(ep("<answer>  </answer>")) == 0.0  # empty answer
    with pytest.raises(ValueError):
        answer_format(tag, style="xml")


def test_tool_call_format() -> None:
    good = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    bad = '<tool_call>{"name": "calculator", "arguments": {</tool_call>'
    messages = [
        {"role": "user", "content": good},  # not the model's: ignored
        {"role": "assistant", "content": good},
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": bad},
    ]
    out = tool_call_format(Episode(messages=messages))
    assert out.score == 0.5 and out.metrics == {"calls": 2.0, "invalid": 1.0}
    assert tool_call_format(Episode(messages=messages[:2]), tools=["search"]).score == 0.0
    no_calls = Episode(messages=[{"role": "assistant", "content": "<answer>2</answer>"}])
    assert tool_call_format(no_calls).score == 1.0 and tool_call_format(no_calls, required=True).score == 0.0


@pytest.mark.parametrize(
    ("length", "penalty"),
    [(0, 0.0), (768, 0.0), (769, -1 / 256), (896, -0.5), (1024, -1.0), (1025, -1.0), (5000, -1.0)],
)
def test_overlong_penalty_dapo_buffer(length: int, penalty: float) -> None:
    episode = Episode(loss_mask=[1] * length, max_model_tokens=1024)
    assert overlong_penalty(episode, buffer=256) == pytest.approx(penalty)


def test_overlong_penalty_kwarg_limit_and_zero_buffer() -> None:
    assert overlong_penalty(Episode(loss_mask=[1] * 90), max_tokens=100, buffer=20) == pytest.approx(-0.5)
    assert overlong_penalty(Episode(loss_mask=[1] * 100), max_tokens=100, buffer=0) == 0.0
    assert overlong_penalty(Episode(loss_mask=[1] * 101), max_tokens=100, buffer=0) == -1.0
    with pytest.raises(ValueError):
        overlong_penalty(Episode(loss_mask=[1] * 5))


def test_episode_final_answer_defaults_to_last_assistant_message() -> None:
    messages = [{"role": "assistant", "content": "first"}, {"role": "user", "content": "hm"},
                {"role": "assistant", "content": "<answer>9</answer>"}]  # fmt: skip
    assert Episode(messages=messages).final_answer == "<answer>9</answer>"
    assert Episode(messages=messages, final_answer="x").final_answer == "x"


def test_registry_resolve_and_errors() -> None:
    assert {"exact_match", "math_verify", "model_judge", "overlong_penalty"} <= set(registered())
    assert resolve("numeric_match") is numeric_match
    assert resolve("agentrl.reward.builtins:exact_match") is exact_match
    with pytest.raises(UnknownRewardError, match="registered"):
        resolve("no_such_reward")
    with pytest.raises(UnknownRewardError, match="cannot import"):
        resolve("no.such.module:fn")

    @register("test_constant_reward")
    def constant(episode: Episode) -> float:
        return 0.25

    assert resolve("test_constant_reward") is constant
    with pytest.raises(ValueError, match="already registered"):
        register("test_constant_reward")(lambda episode: 1.0)


def test_normalise_outputs() -> None:
    assert normalise(True, "f") == FnOutput(1.0)
    assert normalise({"score": 2, "metrics": {"n": 1}}, "f") == FnOutput(2.0, {"n": 1.0})
    with pytest.raises(TypeError):
        normalise("1.0", "f")
    with pytest.raises(ValueError, match="non-finite"):
        normalise(float("nan"), "f")
