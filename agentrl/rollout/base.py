"""The rollout-engine contract every backend implements (vLLM, SGLang, remote HTTP).

Token-in, token-out: engines never see text. Every generated token carries the policy version that produced it,
so an aborted-and-resumed generation can be corrected per token in the loss.
"""

from __future__ import annotations

import abc
from typing import Any, Literal

from agentrl.types import GenOutput, SamplingParams

DrainMode = Literal["abort", "wait"]


class EngineError(RuntimeError):
    """The engine failed this request for a reason retrying elsewhere will not fix."""


class RetryableEngineError(EngineError):
    """The engine died, was drained or timed out: the request may be retried on another engine."""


class RolloutEngine(abc.ABC):
    """One model replica. Implementations are plain async classes; `ray.remote` turns them into actors."""

    @abc.abstractmethod
    async def generate(self, token_ids: list[int], sampling: SamplingParams, request_id: str) -> GenOutput:
        """Generate from token ids. An aborted request returns its partial tokens with finish_reason="abort";
        `preempted=True` marks an abort caused by pause()/update_weights (the caller may resume it)."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None: ...

    @abc.abstractmethod
    async def pause(self) -> None:
        """Abort in-flight requests (they return as preempted) and hold new ones until resume()."""

    @abc.abstractmethod
    async def resume(self) -> None: ...

    @abc.abstractmethod
    async def update_weights(self, source: str, version: int, drain: DrainMode = "abort") -> float:
        """Load new weights from `source` and switch to `version` atomically: no token is sampled on a mix.
        drain="abort" preempts in-flight requests (partial rollout); "wait" lets them finish first.
        Returns the seconds the update took."""

    @abc.abstractmethod
    async def health(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    async def stats(self) -> dict[str, Any]:
        """`in_flight` requests, `tokens_in_flight` (prompt + budget), `tokens_generated`, `version`."""
