"""`check_text_env`: gymnasium's env checker + agentrl's text-env contract + random/expert episodes.

Why: an env written by a user should fail here, with a clear message, not deep inside a training run.
Backs `agentrl check-env ID [key=value ...]`.
"""

from __future__ import annotations

import asyncio
import random
import time
import warnings
from typing import Any

from gymnasium.utils.env_checker import check_env

from agentrl.envs.base import REQUIRED_METRICS, TextEnv
from agentrl.envs.env_calls import BoundedEnv, call_with_timeout
from agentrl.envs.registry import make_env

UNPARSABLE = "I am not sure what to do."
MAX_TURNS_CAP = 10_000


class ContractViolation(Exception):
    """The env breaks the text-env contract (message says how)."""


def check_text_env(
    env_id: str, kwargs: dict[str, Any] | None = None, episodes: int = 20, seed: int = 0, timeout_s: float = 30.0
) -> dict:
    """Run all checks and episodes; returns a report whose "violations" list is empty when the env passes.

    Every env call is bounded by `timeout_s` (a hanging env is a violation, and the check ends there: the hung
    call may still be running on the env); gymnasium's own checker, which makes a few dozen calls, by 10x that.
    Raises UnknownEnvError / TypeError when the env cannot even be built (a usage mistake, not a violation).
    """
    kwargs = dict(kwargs or {})
    env = BoundedEnv(call_with_timeout(make_env, env_id, timeout_s=timeout_s, what="building the env", **kwargs),
                     timeout_s)  # fmt: skip
    violations: list[str] = []
    warned: list[str] = []  # agentrl's own rules that this env does not promise (TextEnv.contract)
    report: dict[str, Any] = {"env": env_id, "kwargs": kwargs, "violations": violations, "warnings": warned}
    promised = getattr(env, "contract", frozenset())
    try:
        problems = call_with_timeout(
            _gymnasium_checks, env_id, kwargs, timeout_s=10 * timeout_s, what="gymnasium's env checker"
        )
        (violations if "gymnasium_checker" in promised else warned).extend(problems)
    except TimeoutError as err:
        violations.append(str(err))
        report["ok"] = False
        return report
    try:
        _contract_checks(env, seed, warned)
        report["random"] = _run_agent(env, "random", episodes, seed)
        env.reset(seed=seed)
        has_expert = env.expert_action() is not None
        report["expert"] = _run_agent(env, "expert", episodes, seed) if has_expert else None
    except ContractViolation as err:
        violations.append(str(err))
    except TimeoutError as err:
        violations.append(str(err))
    except Exception as err:
        violations.append(f"raised {type(err).__name__}: {err}")
    finally:
        try:
            env.close()
        except Exception as err:  # a close that hangs or raises is the env's problem to report, not ours to die of
            violations.append(f"close() raised {type(err).__name__}: {err}")
    report["ok"] = not violations
    return report


def _gymnasium_checks(env_id: str, kwargs: dict[str, Any]) -> list[str]:
    env = make_env(env_id, **kwargs)
    problems = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            check_env(env)
        except Exception as err:
            problems.append(f"gymnasium env checker: {type(err).__name__}: {err}")
    for w in caught:
        message = str(w.message).replace("\x1b[33m", "").replace("\x1b[0m", "").strip()
        if "render fps" not in message:
            problems.append(f"gymnasium env checker: {message}")
    env.close()
    return problems


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ContractViolation(message)


def _check_step(result: Any) -> tuple[str, float, bool, bool, dict]:
    _require(isinstance(result, tuple) and len(result) == 5, "step() must return a 5-tuple")
    obs, reward, terminated, truncated, info = result
    _require(isinstance(obs, str), f"step() observation must be str, got {type(obs).__name__}")
    _require(isinstance(reward, (int, float)), f"step() reward must be a float, got {type(reward).__name__}")
    _require(isinstance(terminated, bool) and isinstance(truncated, bool), "terminated/truncated must be bool")
    _require(isinstance(info, dict) and isinstance(info.get("metrics"), dict), 'step() info needs a "metrics" dict')
    metrics = info["metrics"]
    missing = [k for k in REQUIRED_METRICS if k not in metrics]
    _require(not missing, f"info['metrics'] lacks {missing}")
    bad = [k for k, v in metrics.items() if not isinstance(v, (int, float)) or isinstance(v, bool)]
    _require(not bad, f"info['metrics'] values must be floats: {bad}")
    return obs, float(reward), terminated, truncated, info


def _expect(env: TextEnv, rule: str, condition: bool, message: str, warned: list[str]) -> None:
    """One of agentrl's own rules: a violation for an env that promises it, else a warning."""
    if condition:
        return
    if rule in getattr(env, "contract", frozenset()):
        raise ContractViolation(message)
    warned.append(f"{message} (agentrl's {rule} rule, which this env does not promise)")


def _contract_checks(env: TextEnv, seed: int, warned: list[str]) -> None:
    prompt = env.system_prompt()
    _require(isinstance(prompt, str), "system_prompt() must return text")
    _expect(env, "system_prompt", prompt.strip() != "", "system_prompt() is empty", warned)
    result = env.reset(seed=seed)
    _require(isinstance(result, tuple) and len(result) == 2, "reset() must return (observation, info)")
    obs, info = result
    _require(isinstance(obs, str) and obs != "", "reset() observation must be non-empty text")
    _require(isinstance(info, dict), "reset() info must be a dict")
    _require(env.reset(seed=seed)[0] == obs, "reset(seed) twice gave different observations")
    after, _, terminated, _, info = _check_step(env.step(UNPARSABLE))
    _expect(env, "unparsable_is_noop", info["metrics"]["action_is_valid"] == 0.0,
            "unparsable output must give action_is_valid=0", warned)  # fmt: skip
    _expect(env, "unparsable_is_noop", after == obs and not terminated, "unparsable output must be a no-op", warned)
    expert = env.expert_action()
    _require(expert is None or isinstance(expert, str), "expert_action() must return text or None")
    action = env.random_action(random.Random(seed))
    _require(isinstance(action, str), "random_action() must return text")
    env.reset(seed=seed)
    _, _, _, _, info = _check_step(env.step(action))
    _require(info["metrics"]["action_is_valid"] == 1.0, f"random_action() output {action!r} is not valid")
    corpus = env.tokenizer_corpus(num_episodes=2, seed=seed)
    _require(isinstance(corpus, list) and all(isinstance(t, str) for t in corpus), "tokenizer_corpus: list[str]")


def _run_agent(env: TextEnv, agent: str, episodes: int, seed: int) -> dict[str, float]:
    """Play `episodes` episodes; success rate, mean turns/return, steps/s and reset time."""
    rng = random.Random(seed)
    successes, turns, returns, tool_calls = 0.0, 0, 0.0, 0
    reset_s = step_s = 0.0
    for episode in range(episodes):
        t0 = time.perf_counter()
        env.reset(seed=seed + episode)
        reset_s += time.perf_counter() - t0
        metrics: dict[str, float] = {}
        for _ in range(MAX_TURNS_CAP):
            action = env.expert_action() if agent == "expert" else env.random_action(rng)
            _require(isinstance(action, str), f"{agent} action must be text")
            if _run_tool_calls(env, action):
                tool_calls += 1
                continue
            t0 = time.perf_counter()
            result = env.step(action)
            step_s += time.perf_counter() - t0
            _, reward, terminated, truncated, info = _check_step(result)
            turns += 1
            returns += reward
            metrics = info["metrics"]
            if terminated or truncated:
                break
        else:
            raise ContractViolation(f"an episode did not end within {MAX_TURNS_CAP} turns")
        successes += metrics.get("success", 0.0)
    return {
        "episodes": episodes,
        "success_rate": successes / max(episodes, 1),
        "mean_turns": turns / max(episodes, 1),
        "mean_return": returns / max(episodes, 1),
        "steps_per_s": turns / step_s if step_s > 0 else None,
        "reset_ms": 1000 * reset_s / max(episodes, 1),
        "tool_turns": tool_calls / max(episodes, 1),
    }


# Tools the checker can run for envs that declare them (`env.tools`); the env manager uses the config's tool sets.
BUILTIN_TOOLS = {"calculator": "agentrl.tools.calculator:calculator", "python": "agentrl.tools.pyexec:python"}


def _run_tool_calls(env: TextEnv, action: str) -> bool:
    """Run a turn's tool calls like the env manager would (results to `env.observe_tool_results`, no `step`).

    Only for envs that define `observe_tool_results`; returns False when the turn has no tool call.
    """
    observe = getattr(env, "observe_tool_results", None)
    if observe is None or "<tool_call>" not in action:
        return False
    from agentrl.tools import ParseError, load_python_tool, parse_tool_calls

    results = []
    for call in parse_tool_calls(action):
        if isinstance(call, ParseError):
            results.append(call.message)
        elif call.name not in BUILTIN_TOOLS:
            results.append(f"unknown tool {call.name!r}")
        else:
            result = asyncio.run(load_python_tool(BUILTIN_TOOLS[call.name])(call.arguments))
            results.append(result.content)
    observe(results)
    return True
