"""agentrl.envs (installed from the top-level envs/ folder): text envs, the registry and built-in envs.

Built-in ids: agentrl/Sokoban-v0 (settings as kwargs), agentrl/SimpleSokoban-v0 (6x6, 1 box: the default
training env), agentrl/LargerSokoban-v0 (8x8, 2 boxes), agentrl/FrozenLake-v0, agentrl/GuessNumber-v0
(information gathered over turns), agentrl/LongTail-v0 (uneven lengths and latency, for async benchmarks),
agentrl/GymFrozenLakeText-v0 (gymnasium's FrozenLake via the adapter) and agentrl/OpenEnv-v0 (an env on an
OpenEnv server, e.g. `agentrl serve-envs`; kwargs url, token_env, timeout_s, max_sessions).
Entry points are strings, so importing this package stays cheap.
"""

from agentrl.envs.base import REQUIRED_METRICS, Move, TextEnv
from agentrl.envs.gym_adapter import GymTextAdapter
from agentrl.envs.parsing import AnswerParser
from agentrl.envs.registry import UnknownEnvError, env_kwargs, make_env, register_env, registered_env_ids

__all__ = [
    "REQUIRED_METRICS",
    "AnswerParser",
    "GymTextAdapter",
    "Move",
    "TextEnv",
    "UnknownEnvError",
    "env_kwargs",
    "make_env",
    "register_env",
    "registered_env_ids",
]

_SOKOBAN = "agentrl.envs.sokoban.env:SokobanEnv"
register_env("agentrl/Sokoban-v0", _SOKOBAN)
register_env("agentrl/SimpleSokoban-v0", _SOKOBAN, dim_room=(6, 6), num_boxes=1, inner_walls=(0, 3), max_steps=15)
register_env(
    "agentrl/LargerSokoban-v0",
    _SOKOBAN,
    dim_room=(8, 8),
    num_boxes=2,
    inner_walls=(0, 5),
    search_depth=100,
    max_steps=30,
)
register_env("agentrl/FrozenLake-v0", "agentrl.envs.frozen_lake:FrozenLakeEnv")
register_env("agentrl/GuessNumber-v0", "agentrl.envs.guess_number:GuessNumberEnv")
register_env("agentrl/GymFrozenLakeText-v0", "agentrl.envs.gym_adapter:gym_frozen_lake_text")
register_env("agentrl/MathTool-v0", "agentrl.envs.math_qa:MathToolEnv")
register_env("agentrl/LongTail-v0", "agentrl.envs.long_tail:LongTailEnv")
register_env("agentrl/OpenEnv-v0", "agentrl.envs.remote_openenv:RemoteOpenEnv")
register_env("agentrl/Tasks-v0", "agentrl.envs.tasks:TaskEnv")
