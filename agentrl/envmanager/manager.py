"""EnvManager: a Ray actor that runs many multi-turn episodes concurrently on one asyncio loop.

It owns no prompt text or parsing (the envs do); it owns the token-exact history, tool execution, limits,
timeouts and the conversion of finished episodes into training samples. Groups of episodes on one task seed are
the unit of work (GRPO-style advantages need the whole group).
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from agentrl.config.schema import Config, EnvSpec, SamplingConfig
from agentrl.envmanager.episode import EpisodeResult, EpisodeRunner, EpisodeSpec, Limits
from agentrl.envmanager.samples import episode_metrics, to_samples
from agentrl.types import GenOutput, Sample, SamplingParams


def sampling_params(cfg: SamplingConfig) -> SamplingParams:
    return SamplingParams(**cfg.model_dump())


@dataclass
class GroupResult:
    tag: str
    seed: int
    split: str
    samples: list[Sample] = field(default_factory=list)
    episodes: list[dict[str, float]] = field(default_factory=list)  # per finished episode: episode metrics
    failures: list[str] = field(default_factory=list)  # errors of episodes that crashed or timed out
    missing_rewards: list[str] = field(default_factory=list)
    admitted_version: int = 0  # the policy version (trained batches) when the buffer admitted the group


def _make_env(env_id: str, kwargs: dict) -> Any:
    from agentrl.envs import make_env

    return make_env(env_id, **kwargs)


class EnvManager:
    def __init__(self, cfg: Config, model_path: str, router: Any, reward_pool: Any = None, index: int = 0):
        from transformers import AutoTokenizer

        from agentrl.platform import configure_cpu_threads

        configure_cpu_threads(1)
        self.cfg = cfg
        self.index = index
        self.router = router
        self.reward_pool = reward_pool
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or model_path)
        e = cfg.envs
        limits = Limits(
            max_tokens_per_turn=e.max_tokens_per_turn,
            max_total_tokens=e.max_total_tokens,
            step_timeout_s=e.step_timeout_s,
            max_calls_per_turn=cfg.tools.max_calls_per_turn,
            max_calls_per_episode=cfg.tools.max_calls_per_episode,
            sample_mode=e.sample_mode,
            step_history_window=e.step_history_window,
        )
        self.runner = EpisodeRunner(
            tokenizer,
            self._generate,
            _make_env,
            limits,
            ThreadPoolExecutor(max_workers=e.env_threads, thread_name_prefix="env"),
            toolboxes=self._toolboxes(cfg),
            tool_parser=self._tool_parser(cfg),
        )
        self.counters = {"episodes": 0, "failed": 0, "missing_reward": 0}

    @staticmethod
    def _toolboxes(cfg: Config) -> dict[tuple[str, ...], Any]:
        wanted = {tuple(s.tools) for s in [*cfg.envs.train.values(), *cfg.envs.val.values()] if s.tools}
        if not wanted:
            return {}
        from agentrl.tools import build_toolbox

        return {sets: build_toolbox(cfg.tools, list(sets)) for sets in wanted}

    @staticmethod
    def _tool_parser(cfg: Config):
        from agentrl.tools import parse_tool_calls

        return functools.partial(parse_tool_calls, parser=cfg.tools.parser)

    async def _generate(self, episode_id: str, ids: list[int], sampling: SamplingParams, rid: str) -> GenOutput:
        return await self.router.generate.remote(episode_id, ids, sampling, rid)

    def _spec(self, tag: str, env: EnvSpec, seed: int, i: int, split: str) -> EpisodeSpec:
        sampling = self.cfg.rollout.val_sampling if split == "val" else self.cfg.rollout.sampling
        return EpisodeSpec(
            env_id=env.env_id,
            seed=seed,
            tag=tag,
            group_id=f"{split}/{tag}/{seed}",
            episode_id=f"{split}/{tag}/{seed}/{i}",
            env_kwargs=dict(env.kwargs),
            max_turns=env.max_turns,
            tool_sets=list(env.tools),
            sampling=sampling_params(sampling),
        )

    async def run_group(self, tag: str, seed: int, split: str = "train", group_size: int | None = None) -> GroupResult:
        """Roll out `group_size` episodes of env `tag` on task `seed` concurrently; return their samples."""
        envs = self.cfg.envs.val if split == "val" else self.cfg.envs.train
        if tag not in envs:
            raise KeyError(f"no env tag {tag!r} in envs.{split} (known: {', '.join(envs)})")
        env = envs[tag]
        n = group_size or env.group_size
        results = await asyncio.gather(*(self.runner.run(self._spec(tag, env, seed, i, split)) for i in range(n)))
        out = GroupResult(tag=tag, seed=seed, split=split)
        for ep in results:
            self.router.release.remote(ep.spec.episode_id)
            self.counters["episodes"] += 1
            if ep.failed:
                self.counters["failed"] += 1
                out.failures.append(f"{ep.spec.episode_id}: {ep.error}")
                continue
            episode_return = await self._score(ep, out)
            if episode_return is None:
                continue
            out.samples += to_samples(ep, episode_return, self.cfg.envs.sample_mode)
            out.episodes.append(
                {**episode_metrics(ep, episode_return), **{f"time/{k}": v for k, v in ep.timings.items()}}
            )
        return out

    async def _score(self, ep: EpisodeResult, out: GroupResult) -> float | None:
        """Env return plus the configured reward functions; None (counted, sample dropped) if a reward is missing."""
        if self.reward_pool is None or not self.cfg.reward.functions:
            return ep.env_return * self.cfg.reward.env_reward_weight
        from agentrl.reward import Episode, combine

        episode = Episode(
            messages=ep.messages,
            env_id=ep.spec.env_id,
            env_info=ep.info,
            task=dict(ep.info.get("task") or {}),
            num_model_tokens=sum(ep.loss_mask),
            max_model_tokens=self.cfg.envs.max_tokens_per_turn * max(1, len(ep.turns)),
            episode_id=ep.spec.episode_id,
        )
        result = await self.reward_pool.score(episode)
        total = combine(ep.env_return, result, self.cfg.reward)
        if total is None:
            self.counters["missing_reward"] += 1
            out.missing_rewards.append(f"{ep.spec.episode_id}: {result.missing}")
        return total

    async def run_episode(self, spec: EpisodeSpec) -> dict[str, Any]:
        """One episode as a plain dict (for `agentrl rollout` and debugging)."""
        ep = await self.runner.run(spec)
        self.router.release.remote(spec.episode_id)
        data = asdict(ep)
        data["text"] = self.runner.tokenizer.decode(ep.token_ids)
        return data

    def stats(self) -> dict[str, int]:
        return dict(self.counters)


def start_managers(cfg: Config, model_path: str, router: Any, reward_pool: Any = None) -> list[Any]:
    """`envs.num_managers` EnvManager actors (async, no CPU reservation: they wait on engines and envs)."""
    import ray

    from agentrl.platform import worker_env

    cls = ray.remote(EnvManager).options(max_concurrency=100_000, num_cpus=0, runtime_env={"env_vars": worker_env()})
    return [cls.remote(cfg, model_path, router, reward_pool, i) for i in range(cfg.envs.num_managers)]
