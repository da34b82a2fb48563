"""Installs tests/megatron_cpu/shim.py in any process with this folder on PYTHONPATH, at the moment
`megatron.core` is first imported (processes that never import Megatron, e.g. vLLM, stay untouched), unless
the process sees a CUDA device or AGENTRL_MEGATRON_CPU_SHIM=0.

The shim's device mapping is a torch function mode, which is per thread: it is active in the thread that
imported Megatron (a Ray actor's methods run in its main thread unless it is threaded or async); another thread
calls `sys.modules["agentrl_megatron_cpu_shim"].enter_mode()` first.

Chains to any other sitecustomize further down sys.path.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_AFTER = {"megatron.core.tensor_parallel.random"}


_SHIM = "agentrl_megatron_cpu_shim"


def _load_shim():
    """shim.py under a name of its own (a bare `shim` could be anyone's module)."""
    if _SHIM not in sys.modules:
        spec = importlib.util.spec_from_file_location(_SHIM, os.path.join(_HERE, "shim.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[_SHIM] = mod
        spec.loader.exec_module(mod)
    return sys.modules[_SHIM]


class _MegatronHook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "megatron.core" and fullname not in _AFTER:
            return None
        if fullname == "megatron.core" and os.environ.get("AGENTRL_MEGATRON_CPU_SHIM", "1") != "0":
            import torch

            if not torch.cuda.is_available():  # a process with a GPU keeps real CUDA
                _load_shim().install()
        if fullname not in _AFTER:
            return None
        spec = self._real_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        orig = loader.exec_module

        def exec_module(module, _orig=orig):
            _orig(module)
            shim = sys.modules.get(_SHIM)
            if shim is not None and getattr(shim, "_installed", False):
                shim._patch_megatron_random(module)

        loader.exec_module = exec_module
        return spec

    def _real_spec(self, fullname, path, target):
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None


sys.meta_path.insert(0, _MegatronHook())

# Chain to a sitecustomize elsewhere on the path (this one shadows it).
_rest = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.origin and os.path.dirname(os.path.abspath(_spec.origin)) != _HERE:
    _mod = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)
