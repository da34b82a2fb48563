"""`MathToolEnv` (agentrl/MathTool-v0): seeded multi-step arithmetic word problems, solved with a calculator tool.

The task's ground truth is in `info["task"]` (from reset and every step), so reward functions such as
`math_verify` (agentrl.reward) can score the answer through the reward workers.

Tool calls, the rule: the env manager owns them. A turn whose output holds a tool call
(`<tool_call>{"name": "calculator", "arguments": {...}}</tool_call>`, tool sets named in `MathToolEnv.tools`)
is executed by the env manager, whose tool responses go back to the model as tool messages; the manager then
calls `env.observe_tool_results([content, ...])` when the env defines it, and does NOT call `step` for that
turn. `step` only sees turns without tool calls (one that still has a tool call and no answer is a format
error, a no-op). The episode ends at the first answer: `<answer>N</answer>` or `\\boxed{N}`.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from typing import Any, ClassVar

from agentrl.envs.base import Move, TextEnv
from agentrl.reward.builtins import extract_answer, normalise_text, parse_number

Problem = tuple[str, str]  # question, calculator expression (its value is the answer)
NAMES = ["Ann", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jun"]


def _crates(r: random.Random) -> Problem:
    a, b = r.randint(12, 60), r.randint(12, 48)
    c = r.randint(10, a * b - 10)
    return (
        f"A shop has {a} crates with {b} bottles in each. It sells {c} bottles. How many bottles are left?",
        f"{a} * {b} - {c}",
    )


def _savings(r: random.Random) -> Problem:
    name, a, b, d, q = r.choice(NAMES), r.randint(15, 90), r.randint(6, 30), r.randint(3, 9), r.randint(10, 60)
    c = a * b - q * d
    while c <= 0:
        q = max(1, q // 2)
        c = a * b - q * d
    return (
        f"{name} saves {a} dollars a week for {b} weeks, spends {c} dollars on a bike, and splits the rest "
        f"equally into {d} jars. How many dollars go in each jar?",
        f"({a} * {b} - {c}) / {d}",
    )


def _trip(r: random.Random) -> Problem:
    a, b, c, d = r.randint(40, 120), r.randint(2, 9), r.randint(30, 110), r.randint(2, 9)
    return (
        f"A train runs at {a} km per hour for {b} hours, then at {c} km per hour for {d} hours. "
        "How many km does it travel in total?",
        f"{a} * {b} + {c} * {d}",
    )


def _orchard(r: random.Random) -> Problem:
    a, b, d = r.randint(8, 40), r.randint(8, 40), r.randint(11, 75)
    c = r.randint(1, a * b - 1)
    return (
        f"A farmer plants {a} rows of {b} apple trees. {c} trees die, and every other tree gives {d} apples. "
        "How many apples does the farmer pick?",
        f"({a} * {b} - {c}) * {d}",
    )


TEMPLATES: list[Callable[[random.Random], Problem]] = [_crates, _savings, _trip, _orchard]


class MathToolEnv(TextEnv):
    """One arithmetic word problem per episode; `correct_reward` if the answer equals the ground truth.

    `options={"question": ..., "answer": ...}` at reset poses your own question instead (QA mode; the expert
    then answers without the tool). `success` is 1 after a correct answer; `tool_calls` counts observed tool
    results. Use `correct_reward=0` with a `math_verify` reward function to score only through the workers.
    """

    tools: ClassVar[list[str]] = ["calculator"]  # tool set names this env expects the env manager to offer

    def __init__(self, max_steps: int = 3, correct_reward: float = 1.0, **text_kwargs: Any) -> None:
        super().__init__(max_steps=max_steps, **text_kwargs)
        self.correct_reward = float(correct_reward)

    def system_prompt(self) -> str:
        call = json.dumps({"name": "calculator", "arguments": {"expression": "(12 + 30) * 7"}})
        return (
            "Solve the math word problem. You may use the calculator tool, e.g.\n"
            f"<tool_call>{call}</tool_call>\n"
            f"Give the final number as {self.parser.format(['294'])} or \\boxed{{294}}."
        )

    # ---- episode state -------------------------------------------------------------------------------------
    def _new_episode(self, seed: int, options: dict[str, Any]) -> None:
        if "question" in options:
            self.question, self.expression = str(options["question"]), options.get("expression")
            self.ground_truth = str(options["answer"])
        else:
            rng = random.Random(seed)
            self.question, self.expression = rng.choice(TEMPLATES)(rng)
            from agentrl.tools.calculator import evaluate

            self.ground_truth = str(evaluate(self.expression))
        self.tool_results: list[str] = []
        self.answer: str | None = None

    @property
    def task(self) -> dict[str, Any]:
        return {"question": self.question, "ground_truth": self.ground_truth, "expression": self.expression}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        obs, info = super().reset(seed=seed, options=options)
        return obs, {**info, "task": self.task}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        # \boxed{N} is as good as <answer>N</answer>: rewrite it into the parser's format, then the base rules.
        answer = extract_answer(action) if isinstance(action, str) else None
        obs, reward, terminated, truncated, info = super().step(self.parser.format([answer]) if answer else action)
        info["metrics"]["tool_calls"] = float(len(self.tool_results))
        return obs, reward, terminated, truncated, {**info, "task": self.task}

    def observe_tool_results(self, results: list[str]) -> None:
        """Called by the env manager (and `agentrl check-env`) with the contents of the tool responses."""
        self.tool_results.extend(str(r) for r in results)

    def _observation(self) -> str:
        if self.answer is None:
            return self.question
        verdict = "correct" if self._is_success() else f"incorrect; the answer is {self.ground_truth}"
        return f"Your answer {self.answer} is {verdict}."

    def _canonical_action(self, text: str) -> str | None:
        return text.strip() or None

    def _apply(self, action: str) -> Move:
        self.answer = action
        return Move(self.correct_reward if self._is_success() else 0.0, True, True)

    def _is_success(self) -> bool:
        if self.answer is None:
            return False
        got, want = parse_number(self.answer), parse_number(self.ground_truth)
        if got is not None and want is not None:
            return math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)
        return normalise_text(self.answer) == normalise_text(self.ground_truth)

    # ---- agents ---------------------------------------------------------------------------------------------
    def expert_action(self) -> str | None:
        """First a calculator call on the problem's expression; once its result is observed, that result."""
        if self.expression and not self.tool_results:
            call = {"name": "calculator", "arguments": {"expression": self.expression}}
            return f"<tool_call>{json.dumps(call)}</tool_call>"
        return self.parser.format([self.tool_results[-1] if self.tool_results else self.ground_truth])

    def _expert_move(self) -> str | None:
        return self.ground_truth

    def _random_move(self, rng: random.Random) -> str:
        return str(rng.randint(0, 9999))

    def tokenizer_corpus(self, num_episodes: int, seed: int) -> list[str]:
        """Prompt, questions, the expert's tool call and answer, a tool response, random answers."""
        from agentrl.tools.calculator import evaluate

        rng = random.Random(seed)
        texts = [self.system_prompt()]
        for episode in range(num_episodes):
            self.reset(seed=seed + episode)
            call = self.expert_action() or ""
            result = str(evaluate(self.expression)) if self.expression else self.ground_truth
            texts += [self.question, call, f"<tool_response>\n{result}\n</tool_response>"]
            self.observe_tool_results([result])
            texts += [self.expert_action() or "", self.random_action(rng)]
        return texts
