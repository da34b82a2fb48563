"""`skyrl_gym/<id>`: skyrl-gym's envs (gsm8k, gsm8k_multi_turn, aime, ...) as text envs, on tasks from a dataset.

skyrl-gym envs take their task at construction (`extras`: the dataset row, e.g. `{"reward_spec": {"ground_truth":
"18"}}`) and their first prompt at `init(prompt)`, so the adapter needs a task source: `path` (a JSONL file in
SkyRL's dataset format, one row per task: `prompt` as chat messages plus the env's extras) or `generator`
(`module:fn(seed) -> row`). Task `seed` is row `seed % len(rows)`. The env's own `step` scores and ends the episode:
its reward, its `done`, its observations (the messages it adds; their contents are the next observation). A system
message in the prompt is the system prompt. `expert_format` (e.g. `"#### {}"` for gsm8k) lets the checker and the
SFT warm start answer with the ground truth.
"""

from __future__ import annotations

import copy
import random
from typing import Any

from agentrl.envs.base import Move
from agentrl.envs.tasks import TaskEnv

PREFIX = "skyrl_gym/"


class SkyRLGymEnv(TaskEnv):
    contract = frozenset()  # skyrl-gym's envs score any text their own way

    def __init__(
        self,
        env: str,
        path: str | None = None,
        generator: str | None = None,
        env_config: dict[str, Any] | None = None,
        expert_format: str | None = None,
        max_steps: int = 10,
        **text_kwargs: Any,
    ) -> None:
        if (path is None) == (generator is None):
            raise ValueError(
                f"skyrl_gym/{env} takes its tasks from a dataset: give path (JSONL) or generator (module:fn)"
            )
        import skyrl_gym

        self.skyrl_gym, self.env_name, self.env_config = skyrl_gym, env, env_config or {}
        self.expert_format = expert_format
        super().__init__(path=path, generator=generator, prompt_key="prompt", max_steps=max_steps, **text_kwargs)

    def _new_episode(self, seed: int, options: dict[str, Any]) -> None:
        row = self.tasks(seed)
        prompt = row.get("prompt")
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if not isinstance(prompt, list) or not prompt:
            raise ValueError(f"task {seed}: 'prompt' must be chat messages (or a string): {str(row)[:200]}")
        self.task = {k: v for k, v in row.items() if k != "prompt"}
        self.inner = self.skyrl_gym.make(self.env_name, env_config=self.env_config, extras=row)
        conversation, _ = self.inner.init(prompt)
        system = [m for m in conversation if m.get("role") == "system"]
        self._system = str(system[0]["content"]) if system else self._system
        self._text = "\n\n".join(str(m["content"]) for m in conversation if m.get("role") != "system")
        self.answer, self.score, self.done = None, 0.0, False

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        """The skyrl-gym env's own step: its reward, its end, its next messages."""
        if not isinstance(action, str):
            raise TypeError(f"{type(self).__name__}.step expects model output text, got {type(action).__name__}")
        out = self.inner.step(action)
        self.turns += 1
        self.answer, self.score, self.done = action, float(out["reward"]), bool(out["done"])
        self._text = "\n\n".join(str(m["content"]) for m in out["observations"] or [])
        truncated = not self.done and self.turns >= self.max_steps
        metrics = {"success": float(self.done and self.score >= 1.0), "action_is_valid": 1.0,
                   "action_is_effective": 1.0}  # fmt: skip
        return self._text, self.score, self.done, truncated, {"metrics": metrics, "task": copy.deepcopy(self.task)}

    def _observation(self) -> str:
        return self._text

    def _apply(self, action: str) -> Move:
        raise NotImplementedError  # step is the skyrl-gym env's own

    def close(self) -> None:
        inner = getattr(self, "inner", None)
        if inner is not None:
            inner.close()

    def expert_action(self) -> str | None:
        truth = (self.task.get("reward_spec") or {}).get("ground_truth")
        return None if self.expert_format is None or truth is None else self.expert_format.format(truth)

    def _random_move(self, rng: random.Random) -> str:
        return str(rng.randint(0, 9999))

    def random_action(self, rng: random.Random) -> str:
        return self.expert_format.format(rng.randint(0, 9999)) if self.expert_format else str(rng.randint(0, 9999))


def register() -> list[str]:
    """Register `skyrl_gym/<id>` for every env of the installed skyrl-gym."""
    from skyrl_gym.envs.registration import registry

    from agentrl.envs.registry import register_env

    ids = []
    for name in sorted(registry):
        register_env(f"{PREFIX}{name}", f"{__name__}:SkyRLGymEnv", env=name)
        ids.append(f"{PREFIX}{name}")
    return ids
