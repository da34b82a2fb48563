"""`TaskEnv` (agentrl/Tasks-v0): tasks from a JSONL dataset file or a generator function, as a one-turn text env.

A task source for agent programs (`envs.<split>.<tag>.agent`), which get each task's prompt and fields (`task.data`)
and are scored by what they return, by reward functions over the final conversation, or by stepping the env with
their answer; and a one-turn QA env for the env manager's own loop. Task `seed` is row `seed % len(rows)` of `path`,
or `generator(seed)` (a `module:function` returning a dict): either way a dict with the prompt under `prompt_key`
and any other fields (an `answer` or `ground_truth` is what the env and reward functions such as `exact_match` or
`math_verify` compare against; the whole dict is `info["task"]`).

An answer is the last `<answer>` tag or `\\boxed{}`; it is right when it matches the task's answer as a number, or
else as normalised text. The first answer ends the episode; an unparsable one gets one more try (`max_steps: 2`).
"""

from __future__ import annotations

import copy
import json
import math
import random
from pathlib import Path
from typing import Any

from agentrl.envs.base import Move, TextEnv
from agentrl.plugins import import_object
from agentrl.reward.builtins import extract_answer, normalise_text, parse_number


class TaskEnv(TextEnv):
    """One-turn tasks: `path` (JSONL) or `generator` (module:fn); subclasses give `tasks(seed) -> dict` and `score`."""

    def __init__(
        self,
        path: str | None = None,
        generator: str | None = None,
        prompt_key: str = "prompt",
        system_prompt: str = "",
        **text_kwargs: Any,
    ) -> None:
        super().__init__(**{"max_steps": 2, **text_kwargs})  # an unparsable answer gets one more try
        self.rows: list[dict[str, Any]] = []
        self.generate: Any = None
        if type(self) is TaskEnv or path is not None or generator is not None:
            if (path is None) == (generator is None):
                raise ValueError("give exactly one of path (a JSONL file of tasks) and generator (module:function)")
            if path is not None:
                lines = Path(path).expanduser().read_text().splitlines()
                self.rows = [json.loads(line) for line in lines if line.strip()]
                if not self.rows:
                    raise ValueError(f"no tasks in {path}")
            else:
                self.generate = import_object(str(generator))
        self.prompt_key = prompt_key
        self._system = system_prompt or f"Answer the question. Give the final answer as {self.parser.format(['...'])}"
        self.task: dict[str, Any] = {}
        self.score = 0.0

    def tasks(self, seed: int) -> dict[str, Any]:
        """Task `seed`: a row of the file (cycling) or what the generator makes."""
        return self.generate(seed) if self.generate is not None else self.rows[seed % len(self.rows)]

    def system_prompt(self) -> str:
        return self._system

    def _new_episode(self, seed: int, options: dict[str, Any]) -> None:
        task = self.tasks(seed)
        if not isinstance(task, dict) or not isinstance(task.get(self.prompt_key), str):
            raise ValueError(f"task {seed} has no string {self.prompt_key!r}: {str(task)[:200]}")
        self.task = dict(task)
        self.answer: str | None = None
        self.score = 0.0

    @property
    def truth(self) -> str | None:
        value = self.task.get("answer", self.task.get("ground_truth"))
        return None if value is None else str(value)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        obs, info = super().reset(seed=seed, options=options)
        return obs, {**info, "task": copy.deepcopy(self.task)}  # callers keep infos: never share one

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        answer = extract_answer(action) if isinstance(action, str) else None  # \boxed{} counts as well
        obs, reward, terminated, truncated, info = super().step(self.parser.format([answer]) if answer else action)
        return obs, reward, terminated, truncated, {**info, "task": copy.deepcopy(self.task)}

    def _observation(self) -> str:
        return str(self.task[self.prompt_key]) if self.answer is None else f"Your answer: {self.answer}"

    def _canonical_action(self, text: str) -> str | None:
        return text.strip() or None

    def _apply(self, action: str) -> Move:
        self.answer = action
        self.score = self.score_answer(action)
        return Move(self.score, True, True)

    def score_answer(self, answer: str) -> float:
        """1 when `answer` matches the task's answer (as numbers when both are, else as normalised text), else 0."""
        if self.truth is None:
            return 0.0
        got, want = parse_number(answer), parse_number(self.truth)
        if got is not None and want is not None:
            return float(math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9))
        return float(normalise_text(answer) == normalise_text(self.truth))

    def _is_success(self) -> bool:
        return self.answer is not None and self.score >= 1.0

    def _expert_move(self) -> str | None:
        return self.truth

    def _random_move(self, rng: random.Random) -> str:
        return str(rng.randint(0, 9999))
