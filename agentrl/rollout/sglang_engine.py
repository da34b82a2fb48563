"""SGLang backend: one in-process `sglang.Engine` per engine actor, token-in/token-out, versioned weight updates.

SGLang is CUDA-only, so it is imported lazily (inside `start`) and this module imports on any machine. The
request / result mapping lives in `agentrl.rollout.sglang_protocol`, shared with the remote HTTP backend.

Behaviour log-probs: SGLang (0.5.x sampler, read) returns log(softmax(logits / temperature)) of the sampled token,
after the temperature (as the trainer computes them) but before top-k / top-p renormalisation, and no request or
engine option returns the truncated ones (SGLANG_RETURN_ORIGINAL_LOGPROB=1 only drops the temperature too). So the
config refuses top_p < 1 or top_k > 0 with this backend (`RolloutConfig`): otherwise the trainer's log-probs, of the
truncated distribution the tokens were drawn from, would not be those of the engine.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from agentrl.config.schema import RolloutConfig, SamplingConfig
from agentrl.models.tiny import resolve_model_path
from agentrl.rollout.base import Completion, EngineError, GatedEngine, eos_token_ids
from agentrl.rollout.sglang_protocol import parse_sglang_output, sglang_request
from agentrl.rollout.turn_mailbox import TurnMailbox


class SGLangEngine(TurnMailbox, GatedEngine):
    """`sglang.Engine` in the actor's process (its scheduler runs in SGLang's own subprocesses)."""

    def __init__(self, model_path: str, cfg: RolloutConfig | None = None, *, seed: int = 0, version: int = 0):
        """An engine for `model_path` as `cfg` (rollout.*) sets it up (rollout.kv_cache_gib is vLLM-CPU's: SGLang
        sizes its cache from mem_fraction_static); `cfg.engine_kwargs` win."""
        super().__init__(version)
        cfg = cfg or RolloutConfig()
        model_path = resolve_model_path(model_path)  # a hub id: a snapshot in this node's HF cache
        self.model_path = model_path
        self._engine_args: dict[str, Any] = {
            "model_path": model_path,
            "skip_tokenizer_init": True,
            "dtype": "auto",
            "context_length": cfg.max_model_len,
            "random_seed": seed,
            "mem_fraction_static": cfg.gpu_memory_utilization,
            "disable_cuda_graph": bool(cfg.enforce_eager),
            "log_level": "error",
            "tp_size": cfg.tensor_parallel_size,
            **cfg.engine_kwargs,
        }
        self._eos = eos_token_ids(model_path)
        self._engine: Any = None
        self._start_seconds = 0.0

    async def start(self) -> dict[str, Any]:
        """Build the sglang.Engine (lazy import: SGLang needs CUDA); idempotent.

        Unlike the vLLM engine's, this build stays on the actor's event loop and blocks it while SGLang starts:
        sglang.Engine.__init__ keeps `asyncio.get_running_loop()` as the loop its TokenizerManager and
        async_generate run on (in a worker thread it would make a new loop that nothing runs), and its
        _set_envs_and_config installs a SIGQUIT handler with signal.signal, which only the main thread may do
        (some SGLang releases skip it off the main thread, not all). Read in sglang's
        python/sglang/srt/entrypoints/engine.py (main branch; 0.5.23 itself could not be read here)."""
        if self._engine is None:
            from agentrl.rollout.api_guard import check_sglang

            check_sglang()  # one-line EngineError when the installed SGLang lacks an API we call
            import sglang

            t0 = time.perf_counter()
            self._engine = sglang.Engine(**self._engine_args)
            self._start_seconds = time.perf_counter() - t0
        return {"start_s": self._start_seconds, "version": self._version}

    async def _complete(self, token_ids: list[int], sampling: SamplingConfig, request_id: str) -> Completion:
        try:
            out = await self._engine.async_generate(**sglang_request(token_ids, sampling, request_id, self._eos))
        except asyncio.CancelledError:
            self._engine.tokenizer_manager.abort_request(rid=request_id)
            raise
        except Exception as err:
            raise EngineError(f"SGLang failed request {request_id}: {err}") from err
        return parse_sglang_output(out)

    async def _abort_ids(self, request_ids: list[str]) -> None:
        """SGLang returns an aborted request with finish_reason {"type": "abort"} and the tokens so far."""
        for rid in request_ids:
            self._engine.tokenizer_manager.abort_request(rid=rid)

    async def _load_weights(self, source: str, version: int) -> None:
        """update_weights_from_disk reloads a safetensors snapshot dir (HF names) and flushes the radix cache.
        The async tokenizer-manager call, not Engine.update_weights_from_disk: that one runs its own event loop."""
        from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

        result = await self._engine.tokenizer_manager.update_weights_from_disk(
            UpdateWeightFromDiskReqInput(model_path=source), None
        )
        success, message = result[0], result[1] if len(result) > 1 else ""
        if not success:
            raise EngineError(f"SGLang could not load weights from {source}: {message}")

    async def weight_sync_info(self) -> dict[str, Any]:
        """Disk sync only (`update_weights_from_disk`), in the dtype the engine computes in: its tokenizer
        manager's ModelConfig resolves `dtype: auto`, so snapshots are written in bf16, not fp32 (half the bytes,
        and what the disk check sizes)."""
        await self.start()
        dtype = getattr(getattr(self._engine.tokenizer_manager, "model_config", None), "dtype", None)
        name = str(dtype).removeprefix("torch.") if dtype is not None else None
        return {"collective": False, "dtype": name if name != "auto" else None, "workers": 1}

    async def health(self) -> dict[str, Any]:
        return {"ok": self._engine is not None, "version": self._version, "paused": not self._gate.is_set()}

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
