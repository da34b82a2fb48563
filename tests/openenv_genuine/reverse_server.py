"""A genuine OpenEnv env, served by openenv 0.10.0's own server code (`create_fastapi_app`), not agentrl's.

Reverse-the-word: the observation's `prompt` names a word, the action's `message` is the answer; one turn, reward 1
for the word reversed. It runs in its own virtualenv (`.venv-openenv`, made by scripts/setup_venv.sh: openenv pins
mcp below 2, agentrl's tool server serves MCP with mcp 2.x), as env services run beside a trainer:

    .venv-openenv/bin/python tests/openenv_genuine/reverse_server.py PORT
"""

from __future__ import annotations

import random
import sys

import uvicorn
from openenv.core.env_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

WORDS = ["apple", "river", "stone", "cloud", "tiger", "maple", "orbit", "lemon", "piano", "quilt"]


class ReverseAction(Action):
    message: str = Field(..., description="the answer")


class ReverseObservation(Observation):
    prompt: str = Field("", description="the task, or the verdict")


class ReverseEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # one instance per session: its state is its own

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=None, step_count=0)
        self.word = ""

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs) -> ReverseObservation:
        self.word = random.Random(seed).choice(WORDS)
        self._state = State(episode_id=episode_id, step_count=0)
        return ReverseObservation(prompt=f"Reverse the word: {self.word}")

    def step(self, action: ReverseAction, timeout_s: float | None = None, **kwargs) -> ReverseObservation:
        self._state.step_count += 1
        right = action.message.strip() == self.word[::-1]
        return ReverseObservation(prompt="correct" if right else "wrong", done=True, reward=float(right))

    @property
    def state(self) -> State:
        return self._state


app = create_fastapi_app(ReverseEnv, ReverseAction, ReverseObservation, max_concurrent_envs=8)

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
