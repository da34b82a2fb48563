"""One multi-turn episode: generate, run tool calls or step the env, append observations as token deltas.

Everything slow or foreign (env.reset/step, tools, rewards) runs off the event loop with a timeout, counted from
when the call starts (`agentrl.envs.env_calls`: a hung call gives its thread up, never the others' turn). A crashing
or hanging env fails only its own episode: the episode carries the error and the manager counts it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from agentrl.config.schema import EnvsConfig, SamplingConfig, ToolsConfig
from agentrl.envmanager.chat import ChatTokens
from agentrl.envs.env_calls import acall_with_timeout
from agentrl.rollout.partial import generate_resumable
from agentrl.types import Episode, EpisodeSpec, GenOutput, Turn

GenerateFn = Callable[[str, list[int], SamplingConfig, str], Awaitable[GenOutput]]
Messages = list[dict[str, str]]


@dataclass
class _Running:
    """What one running episode needs besides its `Episode` record."""

    spec: EpisodeSpec
    ep: Episode
    env: Any
    chat: ChatTokens
    box: Any  # the episode's ToolBox, or None
    max_turns: int
    turn_starts: list[int]  # message index where each turn's new context begins (after the system prompt)
    calls_left: int
    ended_with_eos: bool = True  # whether the last model turn ended with an end-of-turn token


class EpisodeRunner:
    """Runs episodes for one env manager: shared tokenizer, generate function, tool boxes and thread pool."""

    def __init__(
        self,
        tokenizer: Any,
        generate: GenerateFn,
        make_env: Callable[[str, dict], Any],
        envs: EnvsConfig,
        tools: ToolsConfig,
        toolboxes: dict[tuple[str, ...], Any] | None = None,
        tool_parser: Callable[[str], list] | None = None,
    ):
        self.tokenizer = tokenizer
        self.generate = generate
        self.make_env = make_env
        self.envs = envs
        self.tools = tools
        self._env_slots = asyncio.Semaphore(envs.env_threads)
        self.toolboxes = toolboxes or {}
        self.tool_parser = tool_parser
        self._chats: dict[tuple[str, ...], ChatTokens] = {}

    def _chat(self, tool_sets: tuple[str, ...]) -> ChatTokens:
        if tool_sets not in self._chats:
            box = self.toolboxes.get(tool_sets)
            self._chats[tool_sets] = ChatTokens(self.tokenizer, box.schemas() if box else None)
        return self._chats[tool_sets]

    async def off_loop(self, fn: Callable, *args: Any) -> Any:
        """`fn(*args)` on an env thread, `envs.env_threads` at a time; a call past `envs.call_timeout_s` frees its
        slot at once."""
        async with self._env_slots:
            return await acall_with_timeout(fn, *args, timeout_s=self.envs.call_timeout_s)

    async def run(self, spec: EpisodeSpec) -> Episode:
        ep = Episode(episode_id=spec.episode_id, group_id=spec.group_id, env_id=spec.env_id)
        try:
            await self._run(spec, ep)
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            ep.error = f"env call timed out after {self.envs.call_timeout_s}s"
        except Exception as err:  # the env's own bug: fail this episode, never the manager
            ep.error = f"{type(err).__name__}: {err}"
        ep.max_model_tokens = spec.sampling.max_tokens * max(1, len(ep.turns))
        return ep

    async def _run(self, spec: EpisodeSpec, ep: Episode) -> None:
        run = await self._start(spec, ep)
        try:
            if run.box is not None:
                await run.box.open_session(spec.episode_id)
            await self._turns(run, spec, ep)
        finally:
            if hasattr(run.env, "aclose"):  # a self-play seat: the other seats stop waiting for this one
                await run.env.aclose()

    async def _turns(self, run: _Running, spec: EpisodeSpec, ep: Episode) -> None:
        try:
            pending: Messages = []  # messages since the last model turn, appended lazily
            for turn_index in range(run.max_turns):
                context = self._next_context(run, pending, turn_index)
                if context is None:
                    ep.truncation = "max_total_tokens"
                    return
                turn = await self._generate(run, *context, turn_index)
                pending = await self._act(run, turn)
                if pending is None:
                    return
            ep.messages += pending  # what the last turn's tools returned: shown in the log, never read by the model
            ep.truncation = "max_turns" if run.max_turns else None
        finally:
            if run.box is not None:
                await run.box.close_session(spec.episode_id)

    async def _start(self, spec: EpisodeSpec, ep: Episode) -> _Running:
        """Build and reset the env; the system prompt and first observation open the chat and the trajectory."""
        sets = tuple(spec.tool_sets)
        chat = self._chat(sets)
        t0 = time.perf_counter()
        env = await self.off_loop(self.make_env, spec.env_id, spec.env_kwargs)
        try:  # an env with `areset` / `astep` (a self-play seat) waits for the other seats on the loop, not a thread
            if hasattr(env, "areset"):
                obs, info = await env.areset(seed=spec.seed)
            else:
                obs, info = await self.off_loop(lambda: env.reset(seed=spec.seed))
        except BaseException:
            if hasattr(env, "aclose"):
                await env.aclose()
            raise
        ep.timings["env"] += time.perf_counter() - t0
        ep.task = dict(info.get("task") or {})
        ep.messages = [{"role": "system", "content": env.system_prompt()}, {"role": "user", "content": obs}]
        ep.append(chat.prompt_ids(ep.messages), model=False)
        if info.get("terminated"):  # over before its first turn (a self-play seat whose game the other seat ended)
            ep.env_return = float(info.get("reward", 0.0))
            ep.metrics = {k: float(v) for k, v in (info.get("metrics") or {}).items()}
        max_turns = 0 if info.get("terminated") else spec.max_turns or env.max_steps
        return _Running(spec, ep, env, chat, self.toolboxes.get(sets), max_turns, [1], self.tools.max_calls_per_episode)

    def _next_context(self, run: _Running, pending: Messages, turn_index: int) -> tuple[list[int], int] | None:
        """Append the messages since the last turn; return this turn's prompt and token budget, or None when the
        episode has no room left. Trajectory-wise the prompt is the whole token history; turn-wise it is the
        system prompt plus the last `turn_history_window` turns' context, rendered anew."""
        ep = run.ep
        if pending:
            run.turn_starts.append(len(ep.messages))
            ep.messages += pending
        if self.envs.sample_mode == "turn":
            start = run.turn_starts[max(0, turn_index - self.envs.turn_history_window)]
            prompt = run.chat.prompt_ids(ep.messages[:1] + ep.messages[start:])
        else:
            if pending:
                delta = run.chat.delta_ids(pending, run.ended_with_eos)
                if len(ep.token_ids) + len(delta) >= self.envs.max_total_tokens:
                    return None
                ep.append(delta, model=False)
            prompt = list(ep.token_ids)
        budget = min(run.spec.sampling.max_tokens, self.envs.max_total_tokens - len(prompt))
        return (prompt, budget) if budget > 0 else None

    async def _generate(self, run: _Running, prompt: list[int], budget: int, turn_index: int) -> Turn:
        """One model turn (resumed across weight updates), appended to the trajectory and the chat."""
        spec, ep = run.spec, run.ep
        t0 = time.perf_counter()
        out = await generate_resumable(
            lambda ids, s, rid: self.generate(spec.episode_id, ids, s, rid),
            prompt,
            spec.sampling.model_copy(update={"max_tokens": budget}),
            spec.request_id(turn_index),
        )
        ep.timings["llm"] += time.perf_counter() - t0
        turn = Turn(prompt, out.token_ids, out.logprobs, out.versions, resumes=out.resumes)
        ep.turns.append(turn)
        ep.append(out.token_ids, model=True, logprobs=out.logprobs, versions=out.versions)
        ep.final_answer = run.chat.model_text(out.token_ids)
        ep.messages.append({"role": "assistant", "content": ep.final_answer})
        run.ended_with_eos = bool(out.token_ids) and out.token_ids[-1] in run.chat.eos_ids
        return turn

    async def _act(self, run: _Running, turn: Turn) -> Messages | None:
        """Run the turn's tool calls, or step the env with its text. Returns the messages the model sees next,
        or None when the env ended the episode."""
        ep, text = run.ep, run.ep.final_answer or ""
        calls = self.tool_parser(text) if run.box is not None and self.tool_parser else []
        if calls:
            pending = await self._run_tools(run, calls, turn)
            if hasattr(run.env, "observe_tool_results"):  # envs that track what the tools returned
                await self.off_loop(run.env.observe_tool_results, [m["content"] for m in pending])
            return pending
        t0 = time.perf_counter()
        if hasattr(run.env, "astep"):
            result = await run.env.astep(text)
        elif getattr(run.env, "inline_step", False):  # see TextEnv.inline_step
            result = run.env.step(text)
        else:
            result = await self.off_loop(run.env.step, text)
        obs, reward, terminated, truncated, info = result
        ep.timings["env"] += time.perf_counter() - t0
        turn.reward = float(reward)
        ep.env_return += float(reward)
        ep.metrics = {k: float(v) for k, v in (info.get("metrics") or {}).items()}
        if terminated or truncated:
            ep.truncation = "env_truncated" if truncated and not terminated else None
            return None
        return [{"role": "user", "content": obs}]

    async def _run_tools(self, run: _Running, calls: list, turn: Turn) -> Messages:
        """Run this turn's tool calls concurrently; malformed or surplus calls become error messages."""
        allowed = min(self.tools.max_calls_per_turn, max(run.calls_left, 0))
        t0 = time.perf_counter()
        contents = await tool_contents(run.box, calls, allowed, run.spec.episode_id)
        turn.tool_calls = min(len(calls), allowed)
        run.calls_left -= turn.tool_calls
        run.ep.timings["tool"] += time.perf_counter() - t0
        run.ep.tool_calls += turn.tool_calls
        return [{"role": "tool", "content": c} for c in contents]


async def tool_contents(box: Any, calls: list, allowed: int, session_id: str) -> list[str]:
    """What the model reads back for one turn's tool calls, run concurrently: each result, or an error message
    for a malformed call, a failed one, or one past the first `allowed` (shared with the SFT warm start's demos,
    so the expert sees exactly what the policy will)."""
    from agentrl.tools import ParseError

    async def one(i: int, call: Any) -> str:
        if isinstance(call, ParseError):
            return f"error: could not parse tool call: {call.message}"
        if i >= allowed:
            return "error: tool call limit reached (per turn or per episode); call skipped"
        res = await box.call(call.name, call.arguments, session_id)
        return res.content if res.ok else f"error: {res.error or res.content}"

    return list(await asyncio.gather(*(one(i, c) for i, c in enumerate(calls))))
