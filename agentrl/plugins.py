"""User modules (`--import MOD`, AGENTRL_IMPORTS=a,b) loaded in the driver and in every Ray worker of a run.

Why: a module that registers an env, tool or reward only registers it in the process that imports it. The CLI
imports it in the driver; env managers, reward workers, the router and engines are separate processes, maybe on
other nodes, so the run hands them the same list through Ray's job runtime env (`ray_runtime_env()`):
AGENTRL_IMPORTS, the modules' own source (Ray's `py_modules`: a module file or package folder that is not an
installed distribution is uploaded once and unpacked on every node, so nothing depends on the driver's working
directory existing there), and `load_user_modules` as the worker setup hook, which Ray runs in each worker
process before it takes any task or actor.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys

IMPORTS_VAR = "AGENTRL_IMPORTS"
SETUP_HOOK = "agentrl.plugins.load_user_modules"

logger = logging.getLogger(__name__)

# What a worker's setup hook failed to import ("module: error"); the env check reports it with its error.
import_errors: list[str] = []


def import_object(ref: str) -> object:
    """`package.module:name` -> that object: the one way user code named in config (tools, rewards, agents, task
    generators, opponents) is loaded. ValueError for a ref without both parts; ImportError / AttributeError as
    Python raises them, for the caller to word."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{ref!r} must look like module:function")
    return getattr(importlib.import_module(module_name), attr)


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


def module_sources(names: list[str] | None = None) -> list[str]:
    """Where the user modules `names` (default: `user_modules()`) live on this machine, for Ray's `py_modules`:
    the folder of a top-level package or the file of a top-level module, for each one that is not part of an
    installed distribution (those are installed on every node already)."""
    from importlib.metadata import packages_distributions

    installed = packages_distributions()
    roots = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    sources: list[str] = []
    for top in dict.fromkeys(name.split(".")[0] for name in user_modules(names)):
        if top in installed:
            continue
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            continue  # not importable here: its import error is the driver's to report
        if spec is None:
            continue
        locations = list(spec.submodule_search_locations or [])
        if locations:
            source = locations[0] if len(locations) == 1 else None  # a namespace package split over folders: no
        else:
            source = spec.origin if spec.origin and spec.origin.endswith(".py") else None
        if source is None or any(os.path.realpath(source).startswith(root + os.sep) for root in roots):
            continue
        if source not in sources:
            sources.append(source)
    return sources


def ray_runtime_env() -> dict:
    """The job runtime env for `ray.init(runtime_env=...)`: every worker, on any node, imports the user modules
    (their source travels as `py_modules`) and gets the driver's collective settings (NCCL_*, GLOO_*, HCCL_*, ...:
    `agentrl.platform.forwarded_env`)."""
    from agentrl.platform import forwarded_env

    env: dict = {
        "env_vars": {**forwarded_env(), IMPORTS_VAR: ",".join(user_modules())},
        "worker_process_setup_hook": SETUP_HOOK,
    }
    sources = module_sources()
    if sources:
        env["py_modules"] = sources
    return env
