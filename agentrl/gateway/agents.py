"""Agents as episodes: an agent program the user wrote against the OpenAI API, run as one episode of a group.

An agent is `async def agent(client, task) -> float | dict | None`: `client` is an `openai.AsyncOpenAI` pointed at
the gateway with this episode's key, `task` an `AgentTask` (the env's first observation and system prompt, the
task data, the model name, the env's tool schemas, and `step` / `call_tool` to act). It returns the reward, a dict
with `reward` and metrics, or None to take the env's return (the sum of the rewards `task.step` got).

Every model call the agent makes is a turn of the episode (`agentrl.gateway.transcript`), so the episode becomes
samples like a native one. The agent is user code: it runs under `gateway.agent_timeout_s`; raising, hanging or
making no model call fails its episode only. An agent that raises after running into the episode's turn or token
limit (the gateway answered 400) is a truncated episode, scored by its env's return, as a native one would be.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

from agentrl.envs.env_calls import EnvCallTimeout
from agentrl.gateway.commands import is_command, reward_from_output, run_command
from agentrl.gateway.server import EpisodeEnded, Gateway, Session
from agentrl.plugins import import_object
from agentrl.types import Episode, EpisodeSpec

AgentFn = Callable[[Any, "AgentTask"], Awaitable[Any]]
_AGENTS: dict[str, AgentFn] = {}


class UnknownAgentError(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def register_agent(name: str) -> Callable[[AgentFn], AgentFn]:
    """Decorator: name an agent for `envs.<split>.<tag>.agent` (a `module:function` path works unregistered)."""

    def wrap(fn: AgentFn) -> AgentFn:
        _AGENTS[name] = fn
        return fn

    return wrap


def resolve_agent(ref: str) -> AgentFn:
    if ":" in ref:
        try:
            fn = import_object(ref)
        except (ImportError, AttributeError, ValueError) as err:
            raise UnknownAgentError(f"cannot import agent {ref!r}: {err}") from None
    elif ref in _AGENTS:
        fn = _AGENTS[ref]
    else:
        known = ", ".join(sorted(_AGENTS)) or "none"
        raise UnknownAgentError(f"unknown agent {ref!r}; registered: {known} (or use module:function)")
    if not asyncio.iscoroutinefunction(fn):
        raise UnknownAgentError(f"agent {ref!r} must be an async function: async def agent(client, task)")
    return fn


class StepResult(NamedTuple):
    observation: str
    reward: float
    done: bool
    info: dict[str, Any]


@dataclass
class AgentTask:
    """What an agent gets besides its client. `step` acts in the episode's env (off the event loop, under
    `envs.call_timeout_s`); its rewards and metrics are the episode's, as for a native episode. `call_tool` runs
    one of the env's configured tools (`tools` holds their OpenAI schemas) and returns what a model would read."""

    prompt: str
    system_prompt: str
    seed: int
    data: dict[str, Any]
    model: str
    tools: list[dict[str, Any]]
    base_url: str
    api_key: str
    _step: Callable[[str], Awaitable[StepResult]] = field(repr=False, default=None)  # type: ignore[assignment]
    _tool: Callable[[str, dict], Awaitable[str]] = field(repr=False, default=None)  # type: ignore[assignment]

    async def step(self, action: str) -> StepResult:
        return await self._step(action)

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        return await self._tool(name, arguments)


class AgentEpisodes:
    """Runs agent episodes for one env manager, beside its native `EpisodeRunner` (whose env threads, tool boxes
    and limits it shares)."""

    def __init__(self, runner: Any, gateway: Gateway, timeout_s: float, command_sandbox: bool = True):
        self.runner = runner
        self.gateway = gateway
        self.timeout_s = timeout_s
        self.command_sandbox = command_sandbox
        self._agents: dict[str, AgentFn] = {}
        self.envs: dict[str, Any] = {}  # episode id -> its env while it runs (the warm start's expert reads it)

    async def run(self, spec: EpisodeSpec, agent: str) -> Episode:
        ep = Episode(episode_id=spec.episode_id, group_id=spec.group_id, env_id=spec.env_id)
        try:
            await self._run(spec, ep, agent)
        except asyncio.CancelledError:
            raise
        except EnvCallTimeout as err:  # the env (stepped by the agent) hung, not the agent
            ep.error = f"{err} (envs.call_timeout_s)"
        except TimeoutError:
            ep.error = f"agent timed out after {self.timeout_s}s (gateway.agent_timeout_s)"
        except Exception as err:  # the agent's or the env's bug: fail this episode, never the manager
            ep.error = f"agent {agent}: {type(err).__name__}: {err}"
        ep.max_model_tokens = spec.sampling.max_tokens * max(1, len(ep.turns))
        return ep

    def agent(self, ref: str) -> AgentFn:
        if ref not in self._agents:
            self._agents[ref] = resolve_agent(ref)
        return self._agents[ref]

    async def _run(self, spec: EpisodeSpec, ep: Episode, agent: str) -> None:
        off_loop = self.runner.off_loop
        t0 = time.perf_counter()
        env = await off_loop(self.runner.make_env, spec.env_id, spec.env_kwargs)
        obs, info = await off_loop(lambda: env.reset(seed=spec.seed))
        ep.timings["env"] += time.perf_counter() - t0
        ep.task = dict(info.get("task") or {})
        self.envs[spec.episode_id] = env
        max_turns = spec.max_turns or getattr(env, "max_steps", None) or 32
        session = self.gateway.open(spec.episode_id, spec.sampling, max_turns)
        box = self.runner.toolboxes.get(tuple(spec.tool_sets))
        if box is not None:
            await box.open_session(spec.episode_id)
        playing = _PlayedEnv(env, ep, session, box, spec, off_loop)
        task = AgentTask(
            prompt=str(obs),
            system_prompt=env.system_prompt() if hasattr(env, "system_prompt") else "",
            seed=spec.seed,
            data=ep.task,
            model=self.gateway.model_name,
            tools=box.schemas() if box is not None else [],
            base_url=f"{self.gateway.url}/v1",
            api_key=session.key,
            _step=playing.step,
            _tool=playing.call_tool,
        )
        session.step = playing.step
        # what a command gets as AGENTRL_TASK: its own OPENAI_BASE_URL / OPENAI_API_KEY tell it where and who it is
        hidden = ("api_key", "base_url")  # (not asdict: it would deep-copy the env behind task.step)
        shown = [f.name for f in fields(task) if f.name[0] != "_" and f.name not in hidden]
        session.task = {name: getattr(task, name) for name in shown}
        result: Any = None
        try:
            result = await self._play(agent, task, session)
        except (asyncio.CancelledError, TimeoutError):
            raise
        except Exception:
            if session.limit is None:
                raise
        finally:
            self.envs.pop(spec.episode_id, None)
            self.gateway.close(session)
            if box is not None:
                await box.close_session(spec.episode_id)
            ep.timings["llm"] += session.llm_s
            self._record(ep, session)
            await off_loop(env.close)
        if session.limit is not None:
            ep.truncation = session.limit  # type: ignore[assignment]
        self._score(ep, result, agent)

    async def _play(self, agent: str, task: AgentTask, session: Session) -> Any:
        """Run the agent program (a command, or a function given an OpenAI client on the gateway); its result."""
        if is_command(agent):
            return await self._command(agent, session)
        client = self.gateway.client(session.key, self.timeout_s)
        return await asyncio.wait_for(self.agent(agent)(client, task), self.timeout_s)

    async def _command(self, agent: str, session: Session) -> Any:
        """Run an agent command (agentrl.gateway.commands); its reward from its output, else None (the env's)."""
        run = await run_command(
            agent, self.gateway.socket_path, session.key, session.task or {}, self.timeout_s, self.command_sandbox
        )
        if run.timed_out:
            raise TimeoutError
        if run.exit_code != 0:
            tail = " | ".join(run.output.strip().splitlines()[-3:])[-300:]
            raise RuntimeError(f"exited with code {run.exit_code}: {tail or '(no output)'}")
        return reward_from_output(run.output)

    @staticmethod
    def _record(ep: Episode, session: Session) -> None:
        """The transcript's main segment becomes the episode's tokens; the other segments its branches."""
        t = session.transcript
        main = t.main
        ep.token_ids, ep.loss_mask, ep.logprobs, ep.versions = (
            main.token_ids,
            main.loss_mask,
            main.logprobs,
            main.versions,
        )
        ep.branches = t.branches
        ep.turns = t.turns
        ep.messages = t.messages
        replies = [m for m in ep.messages if m["role"] == "assistant"]
        ep.final_answer = replies[-1]["content"] if replies else None

    @staticmethod
    def _score(ep: Episode, result: Any, agent: str) -> None:
        if not ep.turns:
            raise ValueError("the agent made no model call (nothing to train on)")
        if isinstance(result, dict):
            if "reward" not in result:
                raise ValueError(f"agent returned a dict without 'reward' (keys: {', '.join(result)})")
            metrics = {k: v for k, v in result.items() if k != "reward"}
            bad = [k for k, v in metrics.items() if not isinstance(v, int | float) or isinstance(v, bool)]
            if bad:
                raise ValueError(f"agent metrics must be numbers; not: {', '.join(bad)}")
            ep.metrics.update({k: float(v) for k, v in metrics.items()})
            result = result["reward"]
        if result is not None:
            if not isinstance(result, int | float) or isinstance(result, bool):
                raise ValueError(
                    f"agent must return a number, a dict with 'reward', or None; got {type(result).__name__}"
                )
            ep.env_return = float(result)


class _PlayedEnv:
    """The env an agent plays, behind `task.step` and `task.call_tool`: each call bounded like the env loop's, its
    reward credited to the last model turn, its metrics and timings to the episode."""

    def __init__(self, env: Any, ep: Episode, session: Session, box: Any, spec: EpisodeSpec, off_loop: Any) -> None:
        self.env, self.ep, self.session, self.box, self.spec, self.off_loop = env, ep, session, box, spec, off_loop
        self.ended = False

    async def step(self, action: str) -> StepResult:
        if self.ended:
            raise EpisodeEnded("the episode's env has ended; no more steps")
        ep, t = self.ep, time.perf_counter()
        o, r, terminated, truncated, i = await self.off_loop(self.env.step, action)
        ep.timings["env"] += time.perf_counter() - t
        ep.env_return += float(r)
        if self.session.transcript.turns:
            self.session.transcript.turns[-1].reward += float(r)
        ep.metrics.update({k: float(v) for k, v in (i.get("metrics") or {}).items()})
        self.ended = bool(terminated or truncated)
        if truncated and not terminated:
            ep.truncation = "env_truncated"
        return StepResult(str(o), float(r), self.ended, dict(i))

    async def call_tool(self, name: str, arguments: dict) -> str:
        if self.box is None:
            raise ValueError(f"env {self.spec.env_id} has no tools configured (envs.<split>.{self.spec.tag}.tools)")
        from agentrl.envmanager.episode import tool_contents
        from agentrl.tools import ToolCall

        t = time.perf_counter()
        (content,) = await tool_contents(self.box, [ToolCall(name, arguments)], 1, self.spec.episode_id)
        self.ep.timings["tool"] += time.perf_counter() - t
        self.ep.tool_calls += 1
        return content
