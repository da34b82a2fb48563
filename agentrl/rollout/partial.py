"""Partial rollout: continue a preempted generation from prompt + partial tokens on the new weights.

The result keeps one policy version per generated token ([v0, ..., v0, v1, ..., v1]) so the loss can correct
each token for the policy that actually sampled it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from agentrl.config.schema import SamplingConfig
from agentrl.rollout.base import RetryableEngineError
from agentrl.types import GenOutput

GenerateFn = Callable[[list[int], SamplingConfig, str], Awaitable[GenOutput]]


async def generate_resumable(
    generate: GenerateFn,
    prompt_ids: list[int],
    sampling: SamplingConfig,
    request_id: str,
    *,
    max_retries: int = 3,
    retry_backoff_s: float = 0.5,
) -> GenOutput:
    """Generate until the request finishes for a reason of its own (stop, length or a caller's abort).

    Preempted pieces (weight updates) are continued with the remaining token budget; a retryable engine failure
    (a dead or drained engine) is retried, keeping the tokens already generated, up to `max_retries` times.
    """
    tokens: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    attempt = resumes = failures = 0
    last: GenOutput | None = None
    while True:
        budget = sampling.max_tokens - len(tokens)
        if budget <= 0:
            reason = "length"
            break
        try:
            last = await generate(
                prompt_ids + tokens, sampling.model_copy(update={"max_tokens": budget}), f"{request_id}-{attempt}"
            )
        except RetryableEngineError:
            failures += 1
            if failures > max_retries:
                raise
            await asyncio.sleep(retry_backoff_s * failures)
            continue
        finally:
            attempt += 1
        tokens += last.token_ids
        logprobs += last.logprobs
        versions += last.versions
        if not last.preempted:
            reason = last.finish_reason
            break
        resumes += 1
    version = versions[-1] if versions else (last.version if last else -1)
    return GenOutput(tokens, logprobs, reason, version, versions=versions, resumes=resumes)
