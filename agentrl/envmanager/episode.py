"""One multi-turn episode: generate, parse tool calls or step the env, append observations as token deltas.

Everything slow or foreign (env.reset/step, tools, rewards) runs off the event loop with a timeout. A crashing
or hanging env fails only its own episode: the result carries the error and the manager counts it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Any

from agentrl.envmanager.chat import ChatTokens
from agentrl.rollout.partial import generate_resumable
from agentrl.types import GenOutput, SamplingParams

GenerateFn = Callable[[str, list[int], SamplingParams, str], Awaitable[GenOutput]]


@dataclass
class EpisodeSpec:
    env_id: str
    seed: int
    tag: str
    group_id: str
    episode_id: str
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 10
    tool_sets: list[str] = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class Turn:
    prompt_ids: list[int]  # what the model saw this turn (the running history in trajectory mode)
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float = 0.0
    tool_calls: int = 0
    resumes: int = 0


@dataclass
class EpisodeResult:
    spec: EpisodeSpec
    turns: list[Turn] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # the whole trajectory, token-exact
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)
    env_return: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    truncation: str | None = None  # max_turns | max_total_tokens | env_truncated | None (terminated)
    timings: dict[str, float] = field(default_factory=lambda: {"llm": 0.0, "env": 0.0, "tool": 0.0})
    error: str | None = None
    final_text: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    tool_calls: int = 0

    @property
    def failed(self) -> bool:
        return self.error is not None

    def append(self, ids: list[int], model: bool, logprobs: list[float] | None = None, versions=None) -> None:
        self.token_ids += ids
        self.loss_mask += [1 if model else 0] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.versions += versions if versions is not None else [-1] * len(ids)


@dataclass
class Limits:
    max_tokens_per_turn: int = 64
    max_total_tokens: int = 4096
    step_timeout_s: float = 30.0
    max_calls_per_turn: int = 4
    max_calls_per_episode: int = 32
    sample_mode: str = "trajectory"
    step_history_window: int = 0


class EpisodeRunner:
    """Runs episodes for one env manager: shared tokenizer, generate function, tool boxes and thread pool."""

    def __init__(
        self,
        tokenizer: Any,
        generate: GenerateFn,
        make_env: Callable[[str, dict], Any],
        limits: Limits,
        executor: Executor,
        toolboxes: dict[tuple[str, ...], Any] | None = None,
        tool_parser: Callable[[str], list] | None = None,
    ):
        self.tokenizer = tokenizer
        self.generate = generate
        self.make_env = make_env
        self.limits = limits
        self.executor = executor
        self.toolboxes = toolboxes or {}
        self.tool_parser = tool_parser
        self._chats: dict[tuple[str, ...], ChatTokens] = {}

    def _chat(self, tool_sets: tuple[str, ...]) -> ChatTokens:
        if tool_sets not in self._chats:
            box = self.toolboxes.get(tool_sets)
            self._chats[tool_sets] = ChatTokens(self.tokenizer, box.schemas() if box else None)
        return self._chats[tool_sets]

    async def _off_loop(self, fn: Callable, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await asyncio.wait_for(loop.run_in_executor(self.executor, fn, *args), self.limits.step_timeout_s)

    async def run(self, spec: EpisodeSpec) -> EpisodeResult:
        result = EpisodeResult(spec=spec)
        try:
            await self._run(spec, result)
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            result.error = f"env call timed out after {self.limits.step_timeout_s}s"
        except Exception as err:  # the env's own bug: fail this episode, never the manager
            result.error = f"{type(err).__name__}: {err}"
        return result

    async def _run(self, spec: EpisodeSpec, result: EpisodeResult) -> None:
        lim = self.limits
        sets = tuple(spec.tool_sets)
        chat = self._chat(sets)
        box = self.toolboxes.get(sets)
        t0 = time.perf_counter()
        env = await self._off_loop(self.make_env, spec.env_id, spec.env_kwargs)
        obs, info = await self._off_loop(lambda: env.reset(seed=spec.seed))
        result.info = dict(info)
        result.messages = [{"role": "system", "content": env.system_prompt()}, {"role": "user", "content": obs}]
        result.timings["env"] += time.perf_counter() - t0
        turn_starts = [1]  # message index where each turn's new context begins (after the system prompt)
        result.append(chat.prompt_ids(result.messages), model=False)
        calls_left = lim.max_calls_per_episode
        if box is not None:
            await box.open_session(spec.episode_id)
        try:
            pending: list[dict[str, str]] = []  # messages since the last model turn, appended lazily
            ended_with_eos = True
            for turn_index in range(spec.max_turns):
                if pending:
                    turn_starts.append(len(result.messages))
                    result.messages += pending
                    if lim.sample_mode == "trajectory":
                        delta = chat.delta_ids(pending, ended_with_eos)
                        if len(result.token_ids) + len(delta) >= lim.max_total_tokens:
                            result.truncation = "max_total_tokens"
                            return
                        result.append(delta, model=False)
                if lim.sample_mode == "step":
                    start = turn_starts[max(0, turn_index - lim.step_history_window)]
                    prompt = chat.prompt_ids(result.messages[:1] + result.messages[start:])
                else:
                    prompt = list(result.token_ids)
                budget = min(lim.max_tokens_per_turn, lim.max_total_tokens - len(prompt))
                if budget <= 0:
                    result.truncation = "max_total_tokens"
                    return
                t0 = time.perf_counter()
                out = await generate_resumable(
                    lambda ids, s, rid: self.generate(spec.episode_id, ids, s, rid),
                    prompt,
                    replace(spec.sampling, max_tokens=budget),
                    f"{spec.episode_id}-t{turn_index}",
                )
                result.timings["llm"] += time.perf_counter() - t0
                turn = Turn(prompt, out.token_ids, out.logprobs, out.versions, resumes=out.resumes)
                result.turns.append(turn)
                result.append(out.token_ids, model=True, logprobs=out.logprobs, versions=out.versions)
                text = chat.model_text(out.token_ids)
                result.final_text = text
                result.messages.append({"role": "assistant", "content": text})
                ended_with_eos = bool(out.token_ids) and out.token_ids[-1] in chat.eos_ids

                calls = self.tool_parser(text) if box is not None and self.tool_parser else []
                if calls:
                    pending = await self._run_tools(box, calls, spec, result, turn, calls_left)
                    calls_left -= turn.tool_calls
                    if hasattr(env, "observe_tool_results"):  # envs that track what the tools returned
                        await self._off_loop(env.observe_tool_results, [m["content"] for m in pending])
                else:
                    t0 = time.perf_counter()
                    obs, reward, terminated, truncated, info = await self._off_loop(env.step, text)
                    result.timings["env"] += time.perf_counter() - t0
                    turn.reward = float(reward)
                    result.env_return += float(reward)
                    result.metrics = {k: float(v) for k, v in (info.get("metrics") or {}).items()}
                    if terminated or truncated:
                        result.truncation = "env_truncated" if truncated and not terminated else None
                        return
                    pending = [{"role": "user", "content": obs}]
            result.truncation = "max_turns"
        finally:
            if box is not None:
                await box.close_session(spec.episode_id)

    async def _run_tools(self, box, calls, spec, result, turn, calls_left) -> list[dict[str, str]]:
        """Run this turn's tool calls concurrently; malformed or surplus calls become error messages."""
        from agentrl.tools import ParseError

        allowed = min(self.limits.max_calls_per_turn, max(calls_left, 0))
        t0 = time.perf_counter()

        async def one(i: int, call: Any) -> str:
            if isinstance(call, ParseError):
                return f"error: could not parse tool call: {call.message}"
            if i >= allowed:
                return "error: tool call limit reached (per turn or per episode); call skipped"
            res = await box.call(call.name, call.arguments, spec.episode_id)
            return res.content if res.ok else f"error: {res.error or res.content}"

        contents = await asyncio.gather(*(one(i, c) for i, c in enumerate(calls)))
        turn.tool_calls = min(len(calls), allowed)
        result.timings["tool"] += time.perf_counter() - t0
        result.tool_calls += turn.tool_calls
        return [{"role": "tool", "content": c} for c in contents]
