"""The one place that knows whether we run on CPU, CUDA or Ascend NPU.

Everything device-specific (torch device, collective backend, Ray resource name, visible-devices variable,
thread settings, vLLM environment) is answered here so that no other module branches on the hardware.
`torch_npu` is imported lazily and only when the package is present: importing it on a machine without the
CANN runtime breaks `import torch` itself.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Literal

PlatformKind = Literal["cpu", "cuda", "npu"]


@dataclass(frozen=True)
class Platform:
    kind: PlatformKind
    device_type: str
    dist_backend: str
    ray_resource: str | None
    visible_devices_env: str | None
    device_count: int

    @property
    def is_accelerator(self) -> bool:
        return self.kind != "cpu"

    @property
    def process_group_backend(self) -> str:
        """`init_process_group` backend of the trainer's default group: gloo for CPU tensors beside the device
        backend ("cpu:gloo,cuda:nccl"). NCCL or HCCL alone has no CPU backend, so any collective on a CPU tensor
        (step bookkeeping, object gathers, barriers) would raise. `dist_backend` stays the bare device backend:
        the weight-sync group builds a single ProcessGroup class from it."""
        if self.kind == "cpu":
            return "gloo"
        return f"cpu:gloo,{self.device_type}:{self.dist_backend}"

    def torch_device(self, index: int = 0):
        import torch

        if self.kind == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, index)

    def device_module(self):
        """`torch.cuda` or `torch.npu` (set_device, get_rng_state, ...); None on CPU. torch.npu exists only once
        torch_npu is imported, so it is imported here, lazily."""
        import torch

        if self.kind == "npu":
            import torch_npu  # noqa: F401  (registers torch.npu)

            return torch.npu
        return torch.cuda if self.kind == "cuda" else None

    def default_dtype(self):
        """float32 on CPU (bf16 matmul is ~65x slower without AVX512/AMX), bf16 on accelerators."""
        import torch

        return torch.float32 if self.kind == "cpu" else torch.bfloat16

    def ray_actor_options(self, num_devices: float = 1.0) -> dict:
        """Resources one rank or engine actor asks Ray for."""
        if self.kind == "cpu":
            return {"num_cpus": 0}
        if self.kind == "cuda":
            return {"num_gpus": num_devices, "num_cpus": 0}
        return {"resources": {self.ray_resource: num_devices}, "num_cpus": 0}

    def actor_env(self) -> dict[str, str]:
        """runtime_env env_vars for every actor the driver starts: `detect()` inside the actor then agrees with the
        driver's choice instead of probing on its own (and a CPU run never grabs a device a node happens to have),
        and the driver's collective settings (`forwarded_env`)."""
        return {**forwarded_env(), "AGENTRL_PLATFORM": self.kind}

    def vllm_env(self) -> dict[str, str]:
        """Environment variables for an in-process vLLM engine on this platform (the CPU KV cache size is an engine
        argument, kv_cache_memory_bytes: vLLM's VLLM_CPU_KVCACHE_SPACE takes whole GiB only)."""
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        if self.kind == "cpu":
            # vLLM's default pins OpenMP threads to cores; on small shared machines that fights the trainer.
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
            env["OMP_NUM_THREADS"] = "1"
            env["THP_MEM_ALLOC_ENABLE"] = "1"  # huge pages for torch's large buffers (see worker_env)
        if self.kind == "npu":
            # vllm-ascend casts linear weights to the FRACTAL_NZ layout after loading (its default, 1); an
            # in-place reload then writes checkpoint-layout tensors over them. vllm-ascend's own weight update
            # refuses to run with it on (v0.23.0 vllm_ascend/worker/worker.py: NPUWorker._check_nz_disabled,
            # called by NPUWorker.start_weight_update): every agentrl weight sync is an in-place reload.
            env["VLLM_ASCEND_ENABLE_NZ"] = "0"
        return env

    def check_vllm_env(self, environ: Mapping[str, str]) -> None:
        """Raise ValueError when `environ` holds a setting an agentrl engine cannot run with: on Ascend, a
        user's explicit VLLM_ASCEND_ENABLE_NZ other than 0 (see vllm_env), refused up front rather than at the
        first weight sync."""
        nz = environ.get("VLLM_ASCEND_ENABLE_NZ", "0")
        if self.kind == "npu" and nz.strip() != "0":
            raise ValueError(
                f"VLLM_ASCEND_ENABLE_NZ={nz}: weight syncs reload the weights in place, which needs the FRACTAL_NZ "
                "layout off (vllm-ascend refuses its own weight updates with it on); unset it or set it to 0"
            )


CPU = Platform("cpu", "cpu", "gloo", None, None, 0)

# The collective libraries' settings (interfaces, timeouts, debug output) that a run takes from the driver's
# environment to every Ray worker: Ray starts workers from each node's raylet, whose environment is not the
# driver's, so NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME / HCCL_CONNECT_TIMEOUT set where `agentrl train` runs would
# otherwise reach no trainer rank or engine on another node (nor on this one, when Ray was started separately).
FORWARDED_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_", "TORCH_GLOO_", "HCCL_", "TORCH_HCCL_", "ASCEND_")
FORWARDED_ENV_NAMES = ("TORCH_DISTRIBUTED_DEBUG",)


def forwarded_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of `environ` (default: this process's) that go to Ray workers: FORWARDED_ENV_PREFIXES and
    FORWARDED_ENV_NAMES, but never a visible-devices list (Ray sets each actor's own, e.g.
    ASCEND_RT_VISIBLE_DEVICES) nor an install location (`*_PATH`, `*_HOME`: each node's own toolkit)."""
    env = os.environ if environ is None else environ
    return {
        k: v
        for k, v in env.items()
        if (k.startswith(FORWARDED_ENV_PREFIXES) or k in FORWARDED_ENV_NAMES)
        and "VISIBLE_DEVICES" not in k
        and not k.endswith(("_PATH", "_HOME"))
    }


def _probe_npu() -> int:
    """Number of Ascend NPUs; 0 when torch_npu is absent or finds no device."""
    if importlib.util.find_spec("torch_npu") is None:
        return 0
    try:
        import torch
        import torch_npu  # noqa: F401  (registers the npu device with torch)

        return int(torch.npu.device_count()) if torch.npu.is_available() else 0
    except Exception:
        return 0


def _probe_cuda() -> int:
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def platform_for(kind: PlatformKind, device_count: int = 0) -> Platform:
    if kind == "cuda":
        return Platform("cuda", "cuda", "nccl", "GPU", "CUDA_VISIBLE_DEVICES", device_count)
    if kind == "npu":
        return Platform("npu", "npu", "hccl", "NPU", "ASCEND_RT_VISIBLE_DEVICES", device_count)
    return CPU


def run_platform(choice: str, cluster_resources: Mapping[str, float]) -> Platform:
    """The platform of the run's actors, from the Ray cluster's resources, never from the driver's own devices (a
    head or login node often has none). `choice` is `Config.platform`; "auto" is NPU when the cluster has an NPU
    resource, else CUDA when it has GPU, else CPU. device_count is the cluster's total of that resource."""
    if choice == "auto":
        kind = (
            "npu" if cluster_resources.get("NPU", 0) > 0 else "cuda" if cluster_resources.get("GPU", 0) > 0 else "cpu"
        )
    elif choice in ("cpu", "cuda", "npu"):
        kind = choice
    else:
        raise ValueError(f"platform must be auto, cpu, cuda or npu, got {choice!r}")
    if kind == "cpu":
        return CPU
    plat = platform_for(kind)  # type: ignore[arg-type]
    return replace(plat, device_count=int(cluster_resources.get(plat.ray_resource or "", 0)))


def cluster_platform(choice: str = "auto") -> Platform:
    """`run_platform` against the Ray cluster this process is connected to. With "auto", AGENTRL_PLATFORM in the
    driver's environment (the documented way to force a choice) wins over the cluster's resources."""
    import ray

    return run_platform(platform_choice(choice), ray.cluster_resources())


def platform_choice(choice: str) -> str:
    """`Config.platform`, except that AGENTRL_PLATFORM in the driver's environment wins over "auto"."""
    forced = os.environ.get("AGENTRL_PLATFORM", "").strip().lower()
    return forced if choice == "auto" and forced else choice


@lru_cache(maxsize=1)
def detect() -> Platform:
    """Detect the platform once per process. AGENTRL_PLATFORM=cpu|cuda|npu forces a choice."""
    forced = os.environ.get("AGENTRL_PLATFORM", "").strip().lower()
    if forced == "cpu":
        return CPU
    if forced in ("cuda", "npu"):
        count = _probe_cuda() if forced == "cuda" else _probe_npu()
        if count == 0:
            raise RuntimeError(f"AGENTRL_PLATFORM={forced} but no {forced} device was found")
        return platform_for(forced, count)  # type: ignore[arg-type]
    if forced:
        raise RuntimeError(f"AGENTRL_PLATFORM must be cpu, cuda or npu, got {forced!r}")
    npus = _probe_npu()
    if npus:
        return platform_for("npu", npus)
    gpus = _probe_cuda()
    if gpus:
        return platform_for("cuda", gpus)
    return CPU


THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TOKENIZERS_PARALLELISM")


def configure_cpu_threads(num_threads: int = 1) -> None:
    """One torch thread per process: with two busy processes on 2 cores, 2 threads each was 6-10x slower."""
    import torch

    for var in THREAD_ENV_VARS[:-1]:
        os.environ.setdefault(var, str(num_threads))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(num_threads)
    try:
        torch.set_num_interop_threads(num_threads)
    except RuntimeError:
        pass  # already set once in this process


def worker_env(platform: Platform | None = None) -> dict[str, str]:
    """Environment for Ray workers (runtime_env env_vars): thread caps on CPU. `platform`: the run's (default: this
    process's), so that a CPU head node does not cap the threads of ranks bound for GPU nodes."""
    env = {"TOKENIZERS_PARALLELISM": "false"}
    if (platform or detect()).kind == "cpu":
        env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
        # torch's large CPU buffers on transparent huge pages: where THP is "madvise" (common), first touches of a
        # fresh weight bucket otherwise cost more than the copy (measured: collective sync of 400 MB 1.6 -> 0.65 s)
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    return env
