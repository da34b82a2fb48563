"""Test-only: run Megatron-Core (local layer spec, no fusions) on a CPU-only torch build.

Megatron-Core hard-codes CUDA in ~80 places that no config flag removes (rotary inv_freq on
`torch.cuda.current_device()`, the model-parallel RNG tracker on the CUDA generator, `device='cuda'` buffers in
DDP / the optimizer / clip_grads, `torch.cuda.FloatTensor` type checks, streams and events). This maps them to
the CPU, process-wide: install it only in processes that run Megatron on CPU (see sitecustomize.py), never in a
shared test process, and never from the package.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_CUDA_TYPES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.ByteTensor": "torch.cuda.ByteTensor",
    "torch.BoolTensor": "torch.cuda.BoolTensor",
}
_CPU = torch.device("cpu")
_installed = False


def _cpu_device(d):
    if isinstance(d, int) and not isinstance(d, bool):
        return _CPU
    if isinstance(d, str) and d.startswith("cuda"):
        return _CPU
    if isinstance(d, torch.device) and d.type == "cuda":
        return _CPU
    return d


class CudaToCpu(TorchFunctionMode):
    """device='cuda' / device=<int> -> CPU; Tensor.cuda() -> self; Tensor.type() reports torch.cuda.* names."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPES.get(name, name)
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if func in (torch.Tensor.to, torch.Tensor.new_empty) or getattr(func, "__name__", "") == "to":
            args = tuple(_cpu_device(a) if isinstance(a, (str, torch.device)) else a for a in args)
        return func(*args, **kwargs)


class _Noop:
    def __init__(self, *a, **k):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def __call__(self, *a, **k):
        return None

    def __getattr__(self, name):
        return _Noop()


def _get_rng_state(device=None, *a, **k):
    return torch.get_rng_state()


def _set_rng_state(state, device=None, *a, **k):
    torch.set_rng_state(state.cpu() if hasattr(state, "cpu") else state)


def _patch_torch() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: _CPU
    cuda.get_rng_state = _get_rng_state
    cuda.set_rng_state = _set_rng_state
    cuda.random.get_rng_state = _get_rng_state
    cuda.random.set_rng_state = _set_rng_state
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed)) and None
    cuda.manual_seed_all = lambda seed: None  # torch.manual_seed calls it after seeding the CPU generator
    cuda.default_generators = (torch.default_generator,)
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda *a, **k: None
    cuda.set_device = lambda *a, **k: None
    cuda.device_count = lambda: 1
    cuda.current_stream = lambda *a, **k: _Noop()
    cuda.default_stream = lambda *a, **k: _Noop()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.Stream = _Noop
    cuda.Event = _Noop
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.memory_reserved = lambda *a, **k: 0
    torch.Tensor.record_stream = lambda self, *a, **k: None
    torch.nn.Module.cuda = lambda self, *a, **k: self
    enter_mode()


def enter_mode() -> None:
    """Activate the device mapping in the calling thread (function modes are thread-local; `install` does it
    for the thread that installs)."""
    CudaToCpu().__enter__()


def _patch_megatron_random(mod) -> None:
    mod._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mod._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # Activation recomputation replays the forward inside autograd's backward, where the (thread-local)
    # function mode of the forward is not active.
    fn = mod.CheckpointFunction
    backward = fn.backward

    def backward_on_cpu(ctx, *grads):
        with CudaToCpu():
            return backward(ctx, *grads)

    fn.backward = staticmethod(backward_on_cpu)


def install() -> None:
    """Patch torch.cuda and the function mode now, and Megatron's RNG helpers (now or when imported)."""
    global _installed
    if _installed:
        return
    _installed = True
    _patch_torch()
    import sys

    mod = sys.modules.get("megatron.core.tensor_parallel.random")
    if mod is not None:
        _patch_megatron_random(mod)
