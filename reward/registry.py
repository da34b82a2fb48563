"""The reward registry: `@register("name")` and `resolve("name" | "module:function")`.

A reward function is `fn(episode, **kwargs) -> float | FnOutput | dict`, sync or async. If it has a
`context` parameter it also receives a `RewardContext` (e.g. the judge router). Config refers to functions
by registered name or as `module:function`, so user rewards need no change to agentrl.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from agentrl.plugins import import_object
from agentrl.reward.types import FnOutput, RewardContext
from agentrl.types import Episode

RewardFn = Callable[..., Any]
_REGISTRY: dict[str, RewardFn] = {}


class UnknownRewardError(ValueError):
    """A reward name that is neither registered nor an importable module:function."""


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make `fn` available to `reward.functions[].name` as `name`."""

    def wrap(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            previous = _REGISTRY[name]
            same = getattr(previous, "__qualname__", None) == fn.__qualname__ and previous.__module__ == fn.__module__
            if not same:  # a module imported twice re-registers itself; a different function is a mistake
                raise ValueError(f"reward {name!r} is already registered to {previous.__module__}.{previous.__name__}")
        _REGISTRY[name] = fn
        return fn

    return wrap


def registered() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def _load_builtins() -> None:
    import agentrl.reward.builtins
    import agentrl.reward.judge  # noqa: F401


def resolve(name: str) -> RewardFn:
    """A registered name, or `package.module:function` (imported; registering is then optional)."""
    if ":" in name:
        try:
            fn = import_object(name)
        except (ImportError, AttributeError, ValueError) as err:
            raise UnknownRewardError(f"cannot import reward {name!r}: {err}") from None
        if not callable(fn):
            raise UnknownRewardError(f"reward {name!r} is not callable")
        return fn
    _load_builtins()
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise UnknownRewardError(f"unknown reward {name!r}; registered: {known} (or use module:function)") from None


def _takes_context(fn: RewardFn) -> bool:
    try:
        return "context" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def normalise(value: Any, name: str) -> FnOutput:
    """float | bool | FnOutput | {"score": ..., "metrics": {...}} -> FnOutput; anything else is an error."""
    if isinstance(value, FnOutput):
        out = value
    elif isinstance(value, dict) and "score" in value:
        out = FnOutput(value["score"], dict(value.get("metrics") or {}))
    elif isinstance(value, (int, float)):
        out = FnOutput(float(value))
    else:
        raise TypeError(f"reward {name} returned {type(value).__name__}, expected a float or FnOutput")
    if out.score is None or not math.isfinite(float(out.score)):
        raise ValueError(f"reward {name} returned a non-finite score {out.score!r}")
    return FnOutput(float(out.score), {k: float(v) for k, v in out.metrics.items()})


async def call_reward(
    fn: RewardFn,
    episode: Episode,
    kwargs: dict[str, Any],
    context: RewardContext | None,
    name: str,
    executor: Executor | None = None,
) -> FnOutput:
    """Run one function: async ones on the loop, sync ones in `executor` threads (a slow one never blocks the
    loop; a thread cannot be killed, so a function that may hang should use isolation=process)."""
    call_kwargs = dict(kwargs)
    if _takes_context(fn):
        call_kwargs["context"] = context or RewardContext()
    if inspect.iscoroutinefunction(fn):
        value = await fn(episode, **call_kwargs)
    else:
        call = functools.partial(fn, episode, **call_kwargs)
        value = await asyncio.get_running_loop().run_in_executor(executor, call)
        if inspect.isawaitable(value):
            value = await value
    return normalise(value, name)


def call_reward_sync(name: str, episode: Episode, kwargs: dict[str, Any]) -> FnOutput:
    """Subprocess entry point (isolation=process): resolve by name there, run, normalise."""
    fn = resolve(name)
    value = fn(episode, **kwargs)
    if inspect.isawaitable(value):
        value = asyncio.run(value)
    return normalise(value, name)
