"""`reasoning_gym/<task>`: every task family of reasoning-gym (106 procedural generators) as a one-turn text env.

Task `seed` is item `seed % size` of the family's dataset (generated on access, reproducible per seed); the question is
the observation, and the answer (the last `<answer>` tag or `\\boxed{}`, else the whole text) is scored by the
family's own `score_answer` (partial credit where the family gives it): that score is the reward, and success is a
full score. Extra dataset settings go in `config` (e.g. `{min_terms: 2, max_terms: 3}` for basic_arithmetic).
"""

from __future__ import annotations

from typing import Any

from agentrl.envs.tasks import TaskEnv

PREFIX = "reasoning_gym/"
EXTRA = "envlibs"


class ReasoningGymEnv(TaskEnv):
    def __init__(
        self,
        task: str,
        config: dict[str, Any] | None = None,
        dataset_seed: int = 0,
        size: int = 1_000_000,
        system_prompt: str = "",
        **text_kwargs: Any,
    ) -> None:
        import reasoning_gym

        self.family = task
        self.dataset = reasoning_gym.create_dataset(task, seed=dataset_seed, size=size, **(config or {}))
        self.size = size
        super().__init__(prompt_key="question", system_prompt=system_prompt, **text_kwargs)

    def tasks(self, seed: int) -> dict[str, Any]:
        self._entry = self.dataset[seed % self.size]
        return {"question": self._entry["question"], "answer": self._entry["answer"], "family": self.family}

    def score_answer(self, answer: str) -> float:
        return float(self.dataset.score_answer(answer, self._entry) or 0.0)


def register() -> list[str]:
    """Register `reasoning_gym/<task>` for every family of the installed reasoning-gym; returns the ids."""
    from agentrl.envs.libraries import quiet
    from agentrl.envs.registry import register_env

    with quiet():  # its dependencies' own SyntaxWarnings (cellpylib) on first import
        import reasoning_gym  # noqa: F401  (the package first: its modules fill the factory's registry)
        from reasoning_gym.factory import DATASETS

    ids = []
    for name in sorted(DATASETS):
        register_env(f"{PREFIX}{name}", f"{__name__}:ReasoningGymEnv", task=name)
        ids.append(f"{PREFIX}{name}")
    return ids
