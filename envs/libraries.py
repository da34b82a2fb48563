"""Envs from the field's libraries, as env ids under a prefix (`reasoning_gym/basic_arithmetic`), registered on first
use: importing a library costs seconds, so no process pays for one it does not use.

Each library is an optional extra; an id of a library that is not installed is a one-line error naming the extra.
"""

from __future__ import annotations

import importlib
import importlib.util

# prefix -> (the library's import name, its pip name, the module whose register() adds its ids)
LIBRARIES: dict[str, tuple[str, str, str]] = {
    "reasoning_gym": ("reasoning_gym", "reasoning-gym", "agentrl.envs.reasoning_gym_env"),
    "textarena": ("textarena", "textarena", "agentrl.envs.textarena_env"),
    "skyrl_gym": ("skyrl_gym", "skyrl-gym", "agentrl.envs.skyrl_gym_env"),
    "gem": ("gem", "gem-llm", "agentrl.envs.gem_env"),
}
EXTRA = "envlibs"
_done: set[str] = set()


class MissingLibraryError(ImportError):
    """An env id of a library that is not installed."""


def register_library_of(env_id: str) -> bool:
    """Register the ids of the library `env_id` belongs to (False when it names no known library)."""
    prefix = env_id.partition("/")[0]
    if prefix not in LIBRARIES:
        return False
    if prefix not in _done:
        module, pip_name, adapter = LIBRARIES[prefix]
        if importlib.util.find_spec(module) is None:
            raise MissingLibraryError(
                f"{env_id} needs the {pip_name} library: pip install 'agentrl[{EXTRA}]' (or pip install {pip_name})"
            )
        importlib.import_module(adapter).register()
        _done.add(prefix)
    return True


def library_env_ids() -> list[str]:
    """Every env id of the installed libraries (imports them: for listings, not for hot paths)."""
    ids: list[str] = []
    for prefix, (module, _, adapter) in LIBRARIES.items():
        if importlib.util.find_spec(module) is not None:
            ids += importlib.import_module(adapter).register()
            _done.add(prefix)
    return ids
