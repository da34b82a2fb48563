"""`model_judge`: a reward that asks a model to grade the episode and parses a score from its reply.

Two backends: the project's rollout router (`context.judge_router`, token ids in and out; the prompt is built
with the judge model's chat template from `model_path`), or a remote OpenAI-compatible endpoint (`url`,
e.g. http://host:8000/v1) called with httpx and rate-limited per URL (`max_concurrency`, `requests_per_s`).
A reply without a parsable score is an error (the reward is marked missing), unless `on_unparsable` gives a
score: a judge that cannot be read must not look like a judge that said 0.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import threading
import time
import uuid
import weakref
from typing import Any

from agentrl.reward.builtins import extract_answer
from agentrl.reward.registry import register
from agentrl.reward.types import FnOutput, RewardContext
from agentrl.types import Episode

DEFAULT_TEMPLATE = (
    "Grade the answer to the question.\n"
    "Question: {question}\n"
    "Reference answer: {ground_truth}\n"
    "Answer: {answer}\n"
    "Reply with 'Score: N', N from 0 (wrong) to {scale} (fully correct)."
)
_SCORE = re.compile(r"(?:score|rating)\s*[:=]?\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class JudgeParseError(ValueError):
    """The judge replied, but with no score in range."""


def parse_score(reply: str, scale: float = 10.0) -> float:
    """'Score: 7' (or the last bare number) -> 0.7 for scale 10; raises JudgeParseError when absent/out of range."""
    labelled = _SCORE.findall(reply)
    numbers = labelled or _NUMBER.findall(reply)
    if not numbers:
        raise JudgeParseError(f"no score in judge reply {reply[:80]!r}")
    value = float(numbers[-1])
    if not 0.0 <= value <= scale:
        raise JudgeParseError(f"judge score {value:g} outside [0, {scale:g}] in {reply[:80]!r}")
    return value / scale


def build_prompt(episode: Episode, template: str, scale: float) -> str:
    """Fill the template: {question} {ground_truth} {answer} {final_answer} {scale}."""
    question = episode.task.get("question")
    if question is None:
        question = next((m.get("content", "") for m in episode.messages if m.get("role") == "user"), "")
    answer = extract_answer(episode.final_answer) or (episode.final_answer or "")
    return template.format(
        question=question,
        ground_truth=episode.ground_truth if episode.ground_truth is not None else "(none)",
        answer=answer,
        final_answer=episode.final_answer or "",
        scale=f"{scale:g}",
    )


_TOKENIZER_LOCK = threading.Lock()  # transformers' lazy imports are not thread-safe; load one at a time


@functools.lru_cache(maxsize=4)
def _load_tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _tokenizer(model_path: str) -> Any:
    with _TOKENIZER_LOCK:
        return _load_tokenizer(model_path)


def _prompt_ids(model_path: str, prompt: str) -> list[int]:
    encoded = _tokenizer(model_path).apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


async def _ask_router(router: Any, model_path: str, prompt: str, max_tokens: int, temperature: float) -> str:
    import ray

    from agentrl.config.schema import SamplingConfig

    ids = await asyncio.to_thread(_prompt_ids, model_path, prompt)
    judge_id = f"judge-{uuid.uuid4().hex[:12]}"
    sampling = SamplingConfig(temperature=temperature, max_tokens=max_tokens)
    ref = router.generate.remote(judge_id, ids, sampling, judge_id)
    try:
        out = await ref
    except asyncio.CancelledError:
        ray.cancel(ref)  # timed out by the pool: stop the generation too
        raise
    finally:
        router.release.remote(judge_id)
    return _tokenizer(model_path).decode(out.token_ids, skip_special_tokens=True)


class _Endpoint:
    """One remote judge URL in one event loop: a shared httpx client (made once: building one costs tens of ms
    of blocking SSL setup), at most `concurrency` requests in flight and `per_s` request starts per second."""

    def __init__(self, concurrency: int, per_s: float | None) -> None:
        import httpx

        self.client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=concurrency))
        self.semaphore = asyncio.Semaphore(concurrency)
        self.interval = 1.0 / per_s if per_s else 0.0
        self.next_start = 0.0

    async def __aenter__(self) -> None:
        await self.semaphore.acquire()
        if self.interval:
            now = time.monotonic()  # no await between read and write: the loop makes this atomic
            wait, self.next_start = self.next_start - now, max(now, self.next_start) + self.interval
            if wait > 0:
                await asyncio.sleep(wait)

    async def __aexit__(self, *exc: Any) -> None:
        self.semaphore.release()


# Per event loop (weakly: a closed loop's clients go with it), then per URL.
_ENDPOINTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, _Endpoint]] = weakref.WeakKeyDictionary()


def _endpoint(url: str, concurrency: int, per_s: float | None) -> _Endpoint:
    per_url = _ENDPOINTS.setdefault(asyncio.get_running_loop(), {})
    if url not in per_url:
        per_url[url] = _Endpoint(concurrency, per_s)
    return per_url[url]


async def _ask_remote(
    url: str, model: str, prompt: str, max_tokens: int, temperature: float, api_key_env: str | None, endpoint: Any
) -> str:
    headers = {}
    if api_key_env and os.environ.get(api_key_env):
        headers["Authorization"] = f"Bearer {os.environ[api_key_env]}"
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": temperature,
    }
    async with endpoint:
        response = await endpoint.client.post(url.rstrip("/") + "/chat/completions", json=body, headers=headers)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"] or ""


@register("model_judge")
async def model_judge(
    episode: Episode,
    context: RewardContext | None = None,
    template: str = DEFAULT_TEMPLATE,
    scale: float = 10.0,
    model_path: str | None = None,
    url: str | None = None,
    model: str = "judge",
    max_tokens: int = 16,
    temperature: float = 0.0,
    api_key_env: str | None = None,
    max_concurrency: int = 8,
    requests_per_s: float | None = None,
    on_unparsable: float | None = None,
) -> FnOutput:
    """Score in [0, 1] from a judge model; metrics: judge_seconds, unparsable (when `on_unparsable` is used)."""
    prompt = build_prompt(episode, template, scale)
    start = time.perf_counter()
    if url is not None:
        endpoint = _endpoint(url, max_concurrency, requests_per_s)
        reply = await _ask_remote(url, model, prompt, max_tokens, temperature, api_key_env, endpoint)
    else:
        router = context.judge_router if context is not None else None
        if router is None or model_path is None:
            raise ValueError("model_judge needs `url`, or a judge router (RewardPool(judge_router=...)) + model_path")
        reply = await _ask_router(router, model_path, prompt, max_tokens, temperature)
    metrics = {"judge_seconds": time.perf_counter() - start}
    try:
        return FnOutput(parse_score(reply, scale), metrics)
    except JudgeParseError:
        if on_unparsable is None:
            raise
        return FnOutput(float(on_unparsable), {**metrics, "unparsable": 1.0})
