"""`register_env` / `make_env`: a thin layer over gymnasium's own registry.

Why not a registry of our own: `gymnasium.make("agentrl/Sokoban-v0")` must work too, and any gymnasium env
with a text adapter should plug in. This module only adds: idempotent registration, the list of ids
registered through agentrl, kwargs introspection for `agentrl envs`, and clear errors.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

import gymnasium as gym
from gymnasium.envs.registration import EnvSpec, load_env_creator

from agentrl.envs.base import TextEnv

_REGISTERED: list[str] = []  # ids registered through register_env, in order


class UnknownEnvError(ValueError):
    """An env id that is not registered (message lists the known ids)."""


def register_env(env_id: str, entry_point: Any, **defaults: Any) -> None:
    """Register `entry_point` (a class, a factory or "module:Class") under `env_id` with default kwargs.

    Registering the same id with the same entry point and defaults again is a no-op, so a module can be
    imported twice (e.g. as `--import` and by a test) without gymnasium's override warning.
    """
    existing = gym.registry.get(env_id)
    if existing is not None and existing.entry_point == entry_point and existing.kwargs == defaults:
        return
    gym.register(id=env_id, entry_point=entry_point, kwargs=dict(defaults), disable_env_checker=True)
    if env_id not in _REGISTERED:
        _REGISTERED.append(env_id)


def registered_env_ids() -> list[str]:
    """Ids registered through `register_env` (built-in ones first), plus any other `agentrl/*` ids."""
    extra = sorted(i for i in gym.registry if i.startswith("agentrl/") and i not in _REGISTERED)
    return [i for i in _REGISTERED if i in gym.registry] + extra


def env_spec(env_id: str) -> EnvSpec:
    from agentrl.envs.libraries import register_library_of

    if env_id not in gym.registry and register_library_of(env_id) and env_id not in gym.registry:
        prefix = env_id.partition("/")[0]
        known = ", ".join(i.partition("/")[2] for i in gym.registry if i.startswith(prefix + "/"))
        raise UnknownEnvError(f"unknown env id {env_id!r}; {prefix} has: {known}")
    try:
        return gym.registry[env_id]
    except KeyError:
        known = ", ".join(registered_env_ids())
        raise UnknownEnvError(f"unknown env id {env_id!r}; registered: {known}") from None


def env_kwargs(env_id: str) -> dict[str, Any]:
    """Every keyword the env accepts, with its effective default (registered defaults beat the signature).

    A "**kwargs" key means the entry point takes keywords that cannot be listed."""
    spec = env_spec(env_id)
    creator = load_env_creator(spec.entry_point) if isinstance(spec.entry_point, str) else spec.entry_point
    params: dict[str, Any] = {}
    target = creator.__init__ if inspect.isclass(creator) else creator
    open_ended = False
    for name, p in inspect.signature(target).parameters.items():
        open_ended = open_ended or p.kind is p.VAR_KEYWORD
        if name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        params[name] = None if p.default is inspect.Parameter.empty else p.default
    if _builds_text_env(creator):
        for name, p in inspect.signature(TextEnv.__init__).parameters.items():
            if name != "self" and name not in params:
                params[name] = p.default
    elif open_ended:
        params["**kwargs"] = None  # a factory that forwards keywords we cannot list
    params.pop("render_mode", None)
    params.update(spec.kwargs)
    return params


def _builds_text_env(creator: Any) -> bool:
    """True for a TextEnv class, or a factory annotated to return one (so it forwards the base kwargs)."""
    if inspect.isclass(creator):
        return issubclass(creator, TextEnv)
    try:
        returned = typing.get_type_hints(creator).get("return")
    except Exception:
        return False
    return inspect.isclass(returned) and issubclass(returned, TextEnv)


def make_env(env_id: str, **kwargs: Any) -> TextEnv:
    """Build a registered text env; returns the `TextEnv` itself (gymnasium's bookkeeping wrappers are
    dropped: a text env enforces its own turn limit, and callers need `system_prompt()` and friends)."""
    spec = env_spec(env_id)  # made from its spec: gym.make would read an id with ":" (gem/game:X) as module:id
    env = gym.make(spec, disable_env_checker=True, **kwargs).unwrapped
    if not isinstance(env, TextEnv):
        raise TypeError(
            f"{env_id} builds {type(env).__name__}, not a TextEnv; wrap it with agentrl.envs.GymTextAdapter"
        )
    return env
