"""The rollout-engine contract every backend implements (vLLM, SGLang, remote HTTP).

Token-in, token-out: engines never see text. Every generated token carries the policy version that produced it,
so an aborted-and-resumed generation can be corrected per token in the loss.
"""

from __future__ import annotations

import abc
import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agentrl.config.schema import SamplingConfig
from agentrl.types import FinishReason, GenOutput

DrainMode = Literal["abort", "wait"]
Completion = tuple[list[int], list[float], FinishReason]
WeightSource = str | dict[str, Any]
"""Where new weights come from: a safetensors folder (rollout.weight_sync=disk), or a collective broadcast:
{"group": SyncGroup fields, "first_rank": this engine's first rank in it, "metas": [(name, shape, dtype)],
"bucket_bytes": int, "delta": bool} (the router fills in first_rank per engine)."""


@dataclass(frozen=True)
class Lease:
    """An episode's engine as the router placed it, for a direct client. `generation` (engine serial, drains so
    far) changes whenever the router drains or replaces that engine: a lease of an older generation is void."""

    index: int
    generation: tuple[int, int]
    handle: Any = field(compare=False)


class EngineError(RuntimeError):
    """The engine failed this request for a reason retrying elsewhere will not fix."""


class RetryableEngineError(EngineError):
    """The engine died, was drained or timed out: the request may be retried on another engine."""


class EngineDeadError(RetryableEngineError):
    """The engine's core is gone (vLLM's EngineDeadError and the like): it will never serve again, so the router
    treats it like a dead actor and restarts it. Named like vLLM's so the router matches both by type name."""


def finish_reason(raw: Any) -> FinishReason:
    """Normalise a backend's finish reason (str, None, or SGLang's {"type": ...}) to stop / length / abort."""
    kind = raw.get("type") if isinstance(raw, dict) else raw
    return kind if kind in ("stop", "length", "abort") else "stop"


class RolloutEngine(abc.ABC):
    """One model replica. Implementations are plain async classes; `ray.remote` turns them into actors."""

    @abc.abstractmethod
    async def generate(self, token_ids: list[int], sampling: SamplingConfig, request_id: str) -> GenOutput:
        """Generate from token ids. An aborted request returns its partial tokens with finish_reason="abort";
        `preempted=True` marks an abort caused by a weight update's drain (the caller may resume it)."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None: ...

    @abc.abstractmethod
    async def update_weights(self, source: WeightSource, version: int, drain: DrainMode = "abort") -> float:
        """Load new weights from `source` and switch to `version` atomically: no token is sampled on a mix.
        drain="abort" preempts in-flight requests (partial rollout); "wait" lets them finish first.
        Returns the seconds the update took."""

    @abc.abstractmethod
    async def health(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    async def stats(self) -> dict[str, Any]:
        """`in_flight` requests, `tokens_in_flight` (prompt + budget), `tokens_generated`, `version`."""


def eos_token_ids(model_path: str) -> list[int]:
    """EOS ids from the model dir: with skip_tokenizer_init vLLM would not know when to stop."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        f = Path(model_path) / name
        if f.exists():
            eos = json.loads(f.read_text()).get("eos_token_id")
            ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    return sorted(set(ids))


class GatedEngine(RolloutEngine):
    """The gate, in-flight bookkeeping, preemption and drain every backend shares; a backend supplies start,
    one completion, abort, and the weight load.

    update_weights closes the gate to new requests, preempts (or waits for) in-flight ones, loads the weights,
    bumps the version and reopens the gate: no token is ever sampled on a mix of two versions.
    """

    def __init__(self, version: int = 0) -> None:
        self._version = version
        self._gate = asyncio.Event()
        self._gate.set()
        self._in_flight: dict[str, int] = {}
        self._preempting: set[str] = set()
        self._tokens_generated = 0
        self._requests_done = 0
        self._held = False  # hold() closed the gate for a weight update still to come

    @abc.abstractmethod
    async def start(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    async def _complete(self, token_ids: list[int], sampling: SamplingConfig, request_id: str) -> Completion:
        """Run one request on the backend; an aborted request returns its partial tokens (reason "abort")."""

    @abc.abstractmethod
    async def _abort_ids(self, request_ids: list[str]) -> None: ...

    @abc.abstractmethod
    async def _load_weights(self, source: WeightSource, version: int) -> None: ...

    async def weight_sync_info(self) -> dict[str, Any]:
        """What a weight sync needs to know: whether the backend receives a collective broadcast, the dtype it
        computes in (None: unknown), and its workers (ranks in the weight-sync group, one per tensor-parallel
        rank). This default is a backend that only reloads from disk."""
        return {"collective": False, "dtype": None, "workers": 1}

    async def can_read(self, path: str) -> bool:
        """Whether this engine's node sees `path` (the disk weight sync's start-up check)."""
        return os.path.exists(path)

    async def generate(self, token_ids: list[int], sampling: SamplingConfig, request_id: str) -> GenOutput:
        await self.start()
        while not self._gate.is_set():
            await self._gate.wait()
        if request_id in self._in_flight:
            raise EngineError(f"request id {request_id!r} is already in flight")
        version = self._version
        self._in_flight[request_id] = len(token_ids) + sampling.max_tokens
        try:
            ids, logprobs, reason = await self._complete(token_ids, sampling, request_id)
        finally:
            self._in_flight.pop(request_id, None)
            preempted = request_id in self._preempting
            self._preempting.discard(request_id)
        if len(logprobs) != len(ids):
            raise EngineError(f"request {request_id}: {len(ids)} tokens but {len(logprobs)} log-probs")
        self._tokens_generated += len(ids)
        self._requests_done += 1
        return GenOutput(ids, logprobs, reason, version, preempted=preempted and reason == "abort")

    async def abort(self, request_id: str) -> None:
        if request_id in self._in_flight:
            await self._abort_ids([request_id])

    async def _drain(self, mode: DrainMode) -> None:
        """With the gate closed: preempt in-flight requests (or let them finish) and wait until none runs."""
        if mode == "abort" and self._in_flight:
            ids = list(self._in_flight)
            self._preempting.update(ids)
            await self._abort_ids(ids)
        while self._in_flight:
            await asyncio.sleep(0.002)

    async def hold(self, drain: DrainMode = "abort") -> None:
        """Close the gate and drain, for an update_weights to come: a collective sync drains every engine first,
        so the group forms at once instead of waiting on the slowest drain."""
        await self.start()
        self._held = self._held or self._gate.is_set()
        self._gate.clear()
        await self._drain(drain)

    async def update_weights(self, source: WeightSource, version: int, drain: DrainMode = "abort") -> float:
        await self.start()
        t0 = time.perf_counter()
        reopen = self._gate.is_set() or self._held
        self._gate.clear()
        try:
            await self._drain(drain)
            await self._load_weights(source if isinstance(source, dict) else str(source), version)
            self._version = version
        finally:
            self._held = False
            if reopen:
                self._gate.set()
        return time.perf_counter() - t0

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
