"""agentrl.reward (installed from the top-level reward/ folder): reward functions, their registry and workers.

- `Episode` (what a function sees), `RewardResult` (score, components, metrics, missing), `FnOutput`.
- `register(name)` / `resolve(name | "module:function")`; `registered()` lists names.
- Built-ins: exact_match, numeric_match, math_verify, answer_format, tool_call_format, overlong_penalty
  (agentrl.reward.builtins) and model_judge (agentrl.reward.judge).
- `RewardPool(cfg.reward, judge_router=None)`: `await score(episode)`, `stats()`, `shutdown()`.
- `combine(env_return, result, cfg.reward)`: total = env_reward_weight * env_return + score (None if missing).
"""

from agentrl.reward.pool import RewardPool, RewardWorker, combine
from agentrl.reward.registry import UnknownRewardError, register, registered, resolve
from agentrl.reward.types import FnOutput, RewardContext, RewardResult
from agentrl.types import Episode

__all__ = [
    "Episode",
    "FnOutput",
    "RewardContext",
    "RewardPool",
    "RewardResult",
    "RewardWorker",
    "UnknownRewardError",
    "combine",
    "register",
    "registered",
    "resolve",
]
