"""EnvManager: a Ray actor that runs many multi-turn episodes concurrently on one asyncio loop.

It owns no prompt text or parsing (the envs do); it owns the token-exact history, tool execution, limits,
timeouts and the conversion of finished episodes into training samples. Groups of episodes on one task seed are
the unit of work (GRPO-style advantages need the whole group).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, NamedTuple

from agentrl.config.schema import Config, EnvConfig, SamplingConfig
from agentrl.envmanager.episode import EpisodeRunner
from agentrl.envmanager.samples import episode_metrics, episode_record, to_samples
from agentrl.rollout.engine_client import EngineClient
from agentrl.types import Episode, EpisodeFailure, EpisodeRecord, EpisodeSpec, GenOutput, Group

logger = logging.getLogger(__name__)


def episode_spec(cfg: Config, split: str, tag: str, seed: int, index: int = 0) -> EpisodeSpec:
    """Episode `index` of env `tag` on task `seed`, as the config says to run it."""
    envs = cfg.envs.val if split == "val" else cfg.envs.train
    if tag not in envs:
        raise KeyError(f"no env tag {tag!r} in envs.{split} (known: {', '.join(envs)})")
    env: EnvConfig = envs[tag]
    return EpisodeSpec(
        env_id=env.env_id,
        seed=seed,
        tag=tag,
        split=split,
        index=index,
        env_kwargs=dict(env.kwargs),
        max_turns=env.max_turns,
        tool_sets=list(env.tools),
        sampling=cfg.rollout.sampling_for(split),
        agent=env.agent,
    )


def self_play_seats(spec: EpisodeSpec, seats: int = 2) -> list[EpisodeSpec]:
    """The episodes of one self-play game: one per seat, sharing the game through the `table` their envs join."""
    table = spec.episode_id
    return [dataclasses.replace(spec, seat=k, env_kwargs={**spec.env_kwargs, "seat": k, "table": table})
            for k in range(seats)]  # fmt: skip


def _make_env(env_id: str, kwargs: dict) -> Any:
    from agentrl.envs import make_env

    return make_env(env_id, **kwargs)


def build_toolboxes(cfg: Config, splits: tuple[str, ...] = ("train", "val")) -> dict[tuple[str, ...], Any]:
    """One Toolbox per distinct tool-set list of the envs of `splits` (remote schemas are fetched here)."""
    specs = [spec for split in splits for spec in getattr(cfg.envs, split).values()]
    wanted = {tuple(s.tools) for s in specs if s.tools}
    if not wanted:
        return {}
    from agentrl.tools import build_toolbox

    return {sets: build_toolbox(cfg.tools, list(sets)) for sets in wanted}


class FirstOfKind:
    """Logs the first failure of each kind (error type + message start) and counts the rest silently: a user
    sees why episodes fail without one warning per episode (the count is `rollout/failed_episodes`)."""

    def __init__(self, where: str, prefix_chars: int = 60, max_kinds: int = 20):
        self.where = where
        self.prefix_chars = prefix_chars
        self.max_kinds = max_kinds  # errors that differ in every episode must not log every episode
        self.seen: set[str] = set()

    def __call__(self, what: str, error: str) -> None:
        kind = error[: self.prefix_chars]
        if kind in self.seen or len(self.seen) > self.max_kinds:
            return
        self.seen.add(kind)
        if len(self.seen) > self.max_kinds:
            logger.warning("%s: over %d kinds of failures; no more are logged", self.where, self.max_kinds)
            return
        logger.warning("%s: %s failed: %s (later failures of this kind are only counted)", self.where, what, error)


class EnvManager:
    def __init__(self, cfg: Config, model_path: str, router: Any, reward_pool: Any = None, index: int = 0):
        from transformers import AutoTokenizer

        from agentrl.platform import configure_cpu_threads

        configure_cpu_threads(1)
        self.cfg = cfg
        self.index = index
        self.engines = EngineClient(router, request_timeout_s=cfg.rollout.request_timeout_s)  # turns skip the router
        self.reward_pool = reward_pool
        self.log_failure = FirstOfKind(f"env manager {index}")
        from agentrl.models.tiny import resolve_model_path  # a hub id: a snapshot in this node's HF cache
        from agentrl.tools import parse_tool_calls

        tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or resolve_model_path(model_path))
        self.runner = EpisodeRunner(
            tokenizer,
            self._generate,
            _make_env,
            cfg.envs,
            cfg.tools,
            toolboxes=build_toolboxes(cfg),
            tool_parser=functools.partial(parse_tool_calls, parser=cfg.tools.parser),
        )

        self._agents: Any = None  # AgentEpisodes, with the gateway started on first use

    async def _generate(self, episode_id: str, ids: list[int], sampling: SamplingConfig, rid: str) -> GenOutput:
        return await self.engines.generate(episode_id, ids, sampling, rid)

    async def _run(self, spec: EpisodeSpec) -> Episode:
        """One episode: the env manager's own loop, or the spec's agent program through the gateway."""
        if spec.agent is None:
            return await self.runner.run(spec)
        if self._agents is None:
            self._agents = await self._start_gateway()
        return await self._agents.run(spec, spec.agent)

    async def _start_gateway(self) -> Any:
        from agentrl.gateway.agents import AgentEpisodes
        from agentrl.gateway.server import Gateway

        g = self.cfg.gateway
        gateway = Gateway(
            self.runner.tokenizer,
            self._generate,
            model_name=g.model_name,
            parser=self.cfg.tools.parser,
            max_total_tokens=self.cfg.envs.max_total_tokens,
            max_body_bytes=g.max_body_bytes,
            token=g.token(),
        )
        await gateway.start(g.host)  # a free port: one gateway per env manager
        logger.info("env manager %d: agent gateway at %s/v1", self.index, gateway.url)
        return AgentEpisodes(self.runner, gateway, g.agent_timeout_s, g.command_sandbox)

    async def run_group(
        self, tag: str, seed: int, split: str = "train", group_size: int | None = None, self_play: bool = True
    ) -> Group:
        """Roll out `group_size` episodes of env `tag` on task `seed` concurrently; return their samples.
        `self_play`: as the train env's config says (False: validation, which plays the env's fixed opponent)."""
        train = self.cfg.envs.train
        n = group_size or (train[tag].group_size if split == "train" and tag in train else 1)
        specs = [episode_spec(self.cfg, split, tag, seed, i) for i in range(n)]
        if self_play and split == "train" and tag in train and train[tag].self_play:
            specs = [seat for spec in specs for seat in self_play_seats(spec)]
        episodes = await asyncio.gather(*(self._run(spec) for spec in specs))
        group = Group(tag=tag, seed=seed, split=split)
        for ep in episodes:
            self.engines.release(ep.episode_id)
            if ep.failed:
                group.failures.append(EpisodeFailure(ep.episode_id, ep.error or ""))
                self.log_failure(f"episode {ep.episode_id} ({ep.env_id})", ep.error or "")
                continue
            scored = await self._score(ep, group)
            if scored is None:
                continue
            episode_return, reward_metrics = scored
            if ep.turns:  # an episode over before its first turn has nothing to train
                group.samples += to_samples(ep, episode_return, self.cfg.envs.sample_mode)
            group.episode_metrics.append({**episode_metrics(ep, episode_return), **reward_metrics})
            if self.cfg.logging.sample_every_steps:  # the run logs a few of them (agentrl.run.episode_log)
                group.episodes.append(episode_record(ep, tag, split, seed, episode_return, self.runner.tool_parser))
        return group

    async def _score(self, ep: Episode, group: Group) -> tuple[float, dict[str, float]] | None:
        """Env return plus the configured reward functions (and their `reward/...` metrics); None (recorded in
        `group.missing_rewards`, no sample) when a reward function failed."""
        if self.reward_pool is None or not self.cfg.reward.functions:
            return ep.env_return * self.cfg.reward.env_reward_weight, {}
        from agentrl.reward import combine

        result = await self.reward_pool.score(ep)
        total = combine(ep.env_return, result, self.cfg.reward)
        if total is None:
            group.missing_rewards.append(f"{ep.episode_id}: {result.missing}")
            return None
        return total, dict(result.metrics)

    async def run_episode(self, spec: EpisodeSpec) -> dict[str, Any]:
        """One episode as a plain dict (for `agentrl rollout` and debugging)."""
        ep = await self._run(spec)
        self.engines.release(spec.episode_id)
        data = asdict(ep)
        data["text"] = self.runner.tokenizer.decode(ep.token_ids)
        return data


def check_turn_limits(cfg: Config) -> None:
    """Reject an env's `max_turns` above its own `max_steps` when it has no tools: the env ends the episode
    first, so the setting could never apply."""
    from agentrl.config import ConfigError
    from agentrl.envs.registry import env_kwargs

    for split, envs in (("train", cfg.envs.train), ("val", cfg.envs.val)):
        for tag, env in envs.items():
            if env.max_turns is None or env.tools or env.agent:  # an agent's calls need not step the env
                continue
            max_steps = env.kwargs.get("max_steps", env_kwargs(env.env_id).get("max_steps"))
            if isinstance(max_steps, int) and env.max_turns > max_steps:
                raise ConfigError(
                    f"envs.{split}.{tag}.max_turns: {env.max_turns} exceeds the env's max_steps ({max_steps}) "
                    f"and the env has no tools, so it cannot apply; set envs.{split}.{tag}.kwargs.max_steps instead"
                )


def _make_each_env(envs: list[tuple[str, str, dict[str, Any], int, str | None, bool]], timeout_s: float) -> str | None:
    """Runs in a Ray worker: import each agent program, build and reset every env, each call within `timeout_s`
    (a self-play env is built as a seat and must have seats); the first failure as one line, or None."""
    from agentrl.envs import UnknownEnvError
    from agentrl.envs.env_calls import EnvCallTimeout, call_with_timeout
    from agentrl.plugins import import_errors

    for where, env_id, kwargs, seed, agent, self_play in envs:
        if agent is not None:  # an agent program must import where it will run, like the env
            from agentrl.gateway.agents import UnknownAgentError, resolve_agent
            from agentrl.gateway.commands import is_command

            try:
                if not is_command(agent):
                    resolve_agent(agent)
            except UnknownAgentError as err:
                return f"{where}.agent: {err} (in a Ray worker)"
        try:
            if self_play:
                seat = {**kwargs, "seat": 0, "table": f"check {where}"}
                try:
                    env = call_with_timeout(_make_env, env_id, seat, timeout_s=timeout_s, what="building the env")
                except TypeError as err:
                    env = err
                if not hasattr(env, "astep"):
                    return (f"{where}.self_play: {env_id} has no seats (the seat / table kwargs, areset and astep, "
                            "as textarena/<two-player game> has)")  # fmt: skip
                continue
            env = call_with_timeout(_make_env, env_id, kwargs, timeout_s=timeout_s, what="building the env")
            call_with_timeout(env.reset, seed=seed, timeout_s=timeout_s, what="env.reset")
            call_with_timeout(env.close, timeout_s=timeout_s, what="env.close")
        except EnvCallTimeout as err:
            return f"{where}: {env_id}: {err} (envs.call_timeout_s)"
        except UnknownEnvError:
            hint = f"; in this worker {'; '.join(import_errors)}" if import_errors else ""
            return (
                f"{where}: unknown env id {env_id!r} in a Ray worker "
                f"(is the module that registers it imported? --import MOD{hint})"
            )
        except Exception as err:
            args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
            return f"{where}: {env_id}({args}) failed: {type(err).__name__}: {err}"
    return None


def check_envs_in_actor(cfg: Config, start_timeout_s: float = 120.0) -> None:
    """Build and reset every configured env once in a Ray worker, started like the env managers, before any
    engine starts: an env that the workers cannot make (module not imported there, bad kwargs, a crashing
    constructor) is one ConfigError line now instead of every episode failing later."""
    import ray

    from agentrl.config import ConfigError
    from agentrl.platform import worker_env

    envs = [
        (f"envs.{split}.{tag}", e.env_id, dict(e.kwargs), e.seed_start, e.agent, getattr(e, "self_play", False))
        for split, section in (("train", cfg.envs.train), ("val", cfg.envs.val))
        for tag, e in section.items()
    ]
    probe = ray.remote(_make_each_env).options(num_cpus=0, runtime_env={"env_vars": worker_env()})
    call_s = cfg.envs.call_timeout_s
    timeout_s = start_timeout_s + 3 * call_s * len(envs)  # the worker's start, then at most 3 bounded calls an env
    try:
        problem = ray.get(probe.remote(envs, call_s), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise ConfigError(f"envs: building the envs in a Ray worker took over {timeout_s:.0f}s") from None
    except ray.exceptions.RayError as err:  # the worker itself died (e.g. a user module that kills it)
        cause = getattr(err, "cause", None) or err
        first = next((line for line in str(cause).splitlines() if line.strip()), type(cause).__name__)
        raise ConfigError(f"envs: the env check worker failed: {type(cause).__name__}: {first}") from None
    if problem is not None:
        raise ConfigError(" ".join(problem.split()))


def start_managers(cfg: Config, model_path: str, router: Any, reward_pool: Any = None) -> list[Any]:
    """`envs.num_managers` EnvManager actors (async, no CPU reservation: they wait on engines and envs)."""
    import ray

    from agentrl.models.hub import hub_env
    from agentrl.platform import worker_env

    env = {**worker_env(), **hub_env()}
    cls = ray.remote(EnvManager).options(max_concurrency=100_000, num_cpus=0, runtime_env={"env_vars": env})
    return [cls.remote(cfg, model_path, router, reward_pool, i) for i in range(cfg.envs.num_managers)]


class Evaluation(NamedTuple):
    """A validation's result: its metrics, and the episodes as records (for RUN_DIR/episodes)."""

    metrics: dict[str, float]
    episodes: list[EpisodeRecord]


async def evaluate(cfg: Config, managers: list[Any], tick: Callable[[], None] = lambda: None) -> Evaluation:
    """`validation.episodes_per_tag` held-out episodes per val tag (the train tags when there are none),
    spread over the env managers; success and return per tag. tick() is called as each episode ends."""
    from agentrl.observe.step_metrics import validation_metrics

    v = cfg.validation
    envs, split = (cfg.envs.val, "val") if cfg.envs.val else (cfg.envs.train, "train")
    jobs = [
        managers[i % len(managers)].run_group.remote(tag, v.seed_start + spec.seed_start + i, split, 1, False)
        for tag, spec in envs.items()
        for i in range(v.episodes_per_tag)
    ]

    async def counted(job: Any) -> Group:
        group = await job
        tick()
        return group

    groups = list(await asyncio.gather(*map(counted, jobs)))
    return Evaluation(validation_metrics(groups) if groups else {}, [r for g in groups for r in g.episodes])
