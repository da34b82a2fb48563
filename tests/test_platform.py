"""Platform layer: real detection on this CPU machine; CUDA and NPU detection is simulated (names say so)."""

from __future__ import annotations

import pytest

from agentrl import platform as plat


@pytest.fixture(autouse=True)
def _fresh_detection(monkeypatch):
    monkeypatch.delenv("AGENTRL_PLATFORM", raising=False)
    plat.detect.cache_clear()
    yield
    plat.detect.cache_clear()


def test_real_detection_on_cpu_machine():
    p = plat.detect()
    assert p.kind == "cpu" and p.dist_backend == "gloo" and p.ray_resource is None
    assert p.process_group_backend == "gloo" and p.device_module() is None
    import torch

    assert p.torch_device() == torch.device("cpu")
    assert p.default_dtype() == torch.float32
    assert "VLLM_CPU_KVCACHE_SPACE" not in p.vllm_env()  # the engine argument kv_cache_memory_bytes sizes it
    assert p.ray_actor_options() == {"num_cpus": 0}


def test_simulated_cuda_detection(monkeypatch):
    monkeypatch.setattr(plat, "_probe_npu", lambda: 0)
    monkeypatch.setattr(plat, "_probe_cuda", lambda: 4)
    p = plat.detect()
    assert (p.kind, p.dist_backend, p.ray_resource, p.visible_devices_env) == (
        "cuda", "nccl", "GPU", "CUDA_VISIBLE_DEVICES",
    )  # fmt: skip
    assert p.device_count == 4 and p.ray_actor_options(0.5) == {"num_gpus": 0.5, "num_cpus": 0}
    assert p.process_group_backend == "cpu:gloo,cuda:nccl"  # bookkeeping collectives need the CPU backend
    import torch

    assert p.device_module() is torch.cuda
    assert "VLLM_CPU_KVCACHE_SPACE" not in p.vllm_env()


def test_simulated_npu_detection_wins_over_cuda(monkeypatch):
    monkeypatch.setattr(plat, "_probe_npu", lambda: 8)
    monkeypatch.setattr(plat, "_probe_cuda", lambda: 2)
    p = plat.detect()
    assert (p.kind, p.dist_backend, p.ray_resource, p.visible_devices_env) == (
        "npu", "hccl", "NPU", "ASCEND_RT_VISIBLE_DEVICES",
    )  # fmt: skip
    assert p.ray_actor_options() == {"resources": {"NPU": 1.0}, "num_cpus": 0}
    assert p.process_group_backend == "cpu:gloo,npu:hccl"


def test_forced_platform_env(monkeypatch):
    monkeypatch.setenv("AGENTRL_PLATFORM", "cuda")
    with pytest.raises(RuntimeError, match="no cuda device"):
        plat.detect()
    plat.detect.cache_clear()
    monkeypatch.setenv("AGENTRL_PLATFORM", "tpu")
    with pytest.raises(RuntimeError, match="cpu, cuda or npu"):
        plat.detect()


def test_npu_probe_never_imports_torch_npu_when_absent():
    import sys

    assert plat._probe_npu() == 0
    assert "torch_npu" not in sys.modules


def test_npu_engines_run_with_fractal_nz_off():
    """Simulated NPU: vLLM engines get VLLM_ASCEND_ENABLE_NZ=0 (in-place reloads need it off: vllm-ascend v0.23.0
    NPUWorker._check_nz_disabled); a user's explicit 1 is refused up front. Other platforms ignore it."""
    npu = plat.platform_for("npu", 1)
    assert npu.vllm_env()["VLLM_ASCEND_ENABLE_NZ"] == "0"
    assert "VLLM_ASCEND_ENABLE_NZ" not in plat.CPU.vllm_env()
    npu.check_vllm_env({"VLLM_ASCEND_ENABLE_NZ": "0"})
    with pytest.raises(ValueError, match="VLLM_ASCEND_ENABLE_NZ=1: weight syncs reload the weights in place"):
        npu.check_vllm_env({"VLLM_ASCEND_ENABLE_NZ": "1"})
    plat.CPU.check_vllm_env({"VLLM_ASCEND_ENABLE_NZ": "1"})
