"""User modules (`--import MOD`, AGENTRL_IMPORTS=a,b) loaded in the driver and in every Ray worker of a run.

Why: a module that registers an env, tool or reward only registers it in the process that imports it. The CLI
imports it in the driver; env managers, reward workers, the router and engines are separate processes, so the
run hands them the same list through Ray's job runtime env (`ray_runtime_env()`): AGENTRL_IMPORTS and a
PYTHONPATH with the driver's working directory, plus `load_user_modules` as the worker setup hook, which Ray runs
in each worker process before it takes any task or actor.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

IMPORTS_VAR = "AGENTRL_IMPORTS"
SETUP_HOOK = "agentrl.plugins.load_user_modules"

logger = logging.getLogger(__name__)

# What a worker's setup hook failed to import ("module: error"); the env check reports it with its error.
import_errors: list[str] = []


class UserImportError(ImportError):
    """A user module that cannot be imported; the message names the module (`--import NAME: error`)."""


def user_modules(modules: list[str] | None = None) -> list[str]:
    """`modules` then AGENTRL_IMPORTS's comma-separated names, without repeats, in order."""
    names = [*(modules or []), *os.environ.get(IMPORTS_VAR, "").split(",")]
    return list(dict.fromkeys(n.strip() for n in names if n.strip()))


def import_user_modules(modules: list[str] | None = None) -> list[str]:
    """Import `modules` and AGENTRL_IMPORTS (the working directory first on sys.path), and record them in
    AGENTRL_IMPORTS so that `ray_runtime_env()` and child processes import them too. Returns the names."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    names = user_modules(modules)
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as err:  # a user module may fail with anything while it runs
            raise UserImportError(f"--import {name}: {type(err).__name__}: {err}") from None
    if names:
        os.environ[IMPORTS_VAR] = ",".join(names)
    return names


def load_user_modules() -> None:
    """Ray worker setup hook: import AGENTRL_IMPORTS. Never raises (Ray would kill the worker with a long,
    unrelated message): a failure is logged and kept in `import_errors` for the env check to report."""
    try:
        import_user_modules()
    except UserImportError as err:
        import_errors.append(str(err))
        logger.warning("agentrl: %s", err)


def ray_runtime_env() -> dict:
    """The job runtime env for `ray.init(runtime_env=...)`: every worker imports the user modules and sees the
    driver's working directory on its PYTHONPATH (Ray expands ${PYTHONPATH} to the node's own value)."""
    return {
        "env_vars": {
            IMPORTS_VAR: ",".join(user_modules()),
            "PYTHONPATH": os.pathsep.join([os.getcwd(), "${PYTHONPATH}"]),
        },
        "worker_process_setup_hook": SETUP_HOOK,
    }
