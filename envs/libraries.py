"""Envs from the field's libraries, as env ids under a prefix (`reasoning_gym/basic_arithmetic`), registered on first
use: importing a library costs seconds, so no process pays for one it does not use.

Each library is an optional extra; an id of a library that is not installed is a one-line error naming the extra.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import threading
import warnings
from collections.abc import Iterator

# prefix -> (the library's import name, its pip name, the module whose register() adds its ids)
LIBRARIES: dict[str, tuple[str, str, str]] = {
    "reasoning_gym": ("reasoning_gym", "reasoning-gym", "agentrl.envs.reasoning_gym_env"),
    "textarena": ("textarena", "textarena", "agentrl.envs.textarena_env"),
    "skyrl_gym": ("skyrl_gym", "skyrl-gym", "agentrl.envs.skyrl_gym_env"),
    "gem": ("gem", "gem-llm", "agentrl.envs.gem_env"),
}
EXTRA = "envlibs"
_done: set[str] = set()
# One registration at a time: an env manager builds envs on several threads, and a thread that imported a library's
# registry module while another was still importing the library would read a half-filled registry (and mark the
# prefix done with ids missing).
_LOCK = threading.RLock()
_QUIET = threading.RLock()


class MissingLibraryError(ImportError):
    """An env id of a library that is not installed."""


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """A library's own prints and SyntaxWarnings swallowed (TextArena's nltk download attempts offline, GEM's
    dependencies' warnings). One section at a time: sys.stdout and the warning filters are process-wide, and two
    overlapping redirects on two threads would leave stdout pointing at a dead buffer."""
    with _QUIET, warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore", SyntaxWarning)
        with contextlib.redirect_stderr(io.StringIO()):
            yield


def _import(module: str) -> None:
    with quiet():
        importlib.import_module(module)


def register_library_of(env_id: str) -> bool:
    """Register the ids of the library `env_id` belongs to (False when it names no known library)."""
    prefix = env_id.partition("/")[0]
    if prefix == "verifiers":  # any verifiers env, by name: it loads in verifiers' own virtualenv (verifiers_env)
        importlib.import_module("agentrl.envs.verifiers_env").register_id(env_id)
        return True
    if prefix not in LIBRARIES:
        return False
    with _LOCK:
        if prefix not in _done:
            module, pip_name, adapter = LIBRARIES[prefix]
            if importlib.util.find_spec(module) is None:
                raise MissingLibraryError(
                    f"{env_id} needs the {pip_name} library: pip install 'agentrl[{EXTRA}]' (or pip install {pip_name})"
                )
            _import(module)  # the whole library first: its registry fills as it imports
            importlib.import_module(adapter).register()
            _done.add(prefix)
    return True


def library_env_ids() -> list[str]:
    """Every env id of the installed libraries (imports them: for listings, not for hot paths)."""
    ids: list[str] = []
    with _LOCK:
        for prefix, (module, _, adapter) in LIBRARIES.items():
            if importlib.util.find_spec(module) is not None:
                _import(module)
                ids += importlib.import_module(adapter).register()
                _done.add(prefix)
    return ids
