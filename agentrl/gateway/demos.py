"""The SFT warm start of an agent program: its own code plays, with the env's expert answering in the model's place.

So the demos have exactly the agent's prompts and tool format, whatever they are. The agent names how its model
should say an expert move (`agent.expert_reply(action) -> str`, e.g. a `move` tool call for `<answer>Up</answer>`);
each call to the gateway is answered with that text's tokens, the expert reading the env the agent is stepping.
With `trainer.sft.expert_noise` a random move is answered now and then (a mistake to recover from): played, never
trained on.
"""

from __future__ import annotations

import random
from typing import Any

from agentrl.config import ConfigError
from agentrl.config.schema import Config, SamplingConfig, TrainEnvConfig
from agentrl.envmanager.episode import EpisodeRunner
from agentrl.envmanager.samples import to_samples
from agentrl.envs.env_calls import acall_with_timeout
from agentrl.gateway.agents import AgentEpisodes
from agentrl.gateway.server import Gateway, GatewayError
from agentrl.types import Episode, EpisodeSpec, GenOutput, Sample

NOISY = -2  # the version a noisy demo turn's tokens carry until they are masked out


def _make_env(env_id: str, kwargs: dict) -> Any:
    from agentrl.envs import make_env

    return make_env(env_id, **kwargs)


class AgentDemos:
    """Plays demo episodes of agent envs on a gateway of its own (start it on the loop that plays them)."""

    def __init__(self, cfg: Config, tokenizer: Any, toolboxes: dict, noise_seed: int):
        self.cfg, self.tokenizer, self.noise_seed = cfg, tokenizer, noise_seed
        runner = EpisodeRunner(tokenizer, self._generate, _make_env, cfg.envs, cfg.tools, toolboxes)
        self.gateway = Gateway(
            tokenizer,
            self._generate,
            model_name=cfg.gateway.model_name,
            parser=cfg.tools.parser,
            max_total_tokens=cfg.envs.max_total_tokens,
        )
        self.episodes = AgentEpisodes(runner, self.gateway, cfg.gateway.agent_timeout_s)
        self._play: dict[str, tuple[Any, random.Random]] = {}  # episode id -> (expert_reply, noise rng)
        self._over: set[str] = set()
        self._too_long: dict[str, int] = {}

    async def start(self) -> None:
        await self.gateway.start("127.0.0.1")

    async def aclose(self) -> None:
        await self.gateway.stop()

    async def play(self, tag: str, spec: TrainEnvConfig, seed: int, i: int) -> list[Sample]:
        """Demo episode `i` of agent env `tag` on task `seed`: its model turns as samples."""
        ep = await self.episode(tag, spec, seed, i)
        samples = to_samples(ep, 0.0, self.cfg.envs.sample_mode)
        for s in samples:  # noisy turns were played, not trained on
            s.loss_mask = [0 if v == NOISY else m for v, m in zip(s.versions, s.loss_mask, strict=True)]
            s.versions = [-1] * len(s.versions)
        return [s for s in samples if s.num_model_tokens]

    async def episode(self, tag: str, spec: TrainEnvConfig, seed: int, i: int) -> Episode:
        """The agent's episode with the expert answering (raises on a failure other than the expert running out
        of moves, which ends the episode with the turns it has)."""
        fn = self.episodes.agent(spec.agent or "")
        reply = getattr(fn, "expert_reply", None)
        if not callable(reply):
            raise ConfigError(
                f"envs.train.{tag}: agent {spec.agent} has no expert_reply(action) -> str, which the SFT warm start "
                "needs to play it with the env's expert; give it one or set trainer.sft.enabled=false"
            )
        run = EpisodeSpec(
            spec.env_id, seed, tag, "demo", i, dict(spec.kwargs), spec.max_turns, list(spec.tools),
            self.cfg.rollout.sampling, spec.agent,
        )  # fmt: skip
        self._play[run.episode_id] = (reply, random.Random(self.noise_seed * (i + 1)))
        try:
            ep = await self.episodes.run(run, spec.agent or "")
        finally:
            self._play.pop(run.episode_id, None)
            over = run.episode_id in self._over
            self._over.discard(run.episode_id)
            too_long = self._too_long.pop(run.episode_id, None)
        if too_long is not None:
            raise ConfigError(
                f"envs.train.{tag}: the expert's reply takes {too_long} tokens, over rollout.sampling.max_tokens "
                f"({self.cfg.rollout.sampling.max_tokens}): the policy could never say it"
            )
        if ep.error is not None and not (over and ep.turns):
            raise RuntimeError(ep.error)
        return ep

    async def _generate(self, episode_id: str, ids: list[int], sampling: SamplingConfig, rid: str) -> GenOutput:
        """The expert's move, said the way the agent wants it, as tokens (a random move now and then)."""
        reply, rng = self._play[episode_id]
        env = self.episodes.envs[episode_id]
        timeout_s = self.cfg.envs.call_timeout_s
        action = await acall_with_timeout(env.expert_action, timeout_s=timeout_s, what="env.expert_action")
        if action is None:  # no expert move from here: the demo ends with the turns it has
            self._over.add(episode_id)
            raise GatewayError(409, "the expert has no move here; the demo episode ends", "demo_over")
        noise = self.cfg.trainer.sft.expert_noise
        noisy = bool(noise) and rng.random() < noise
        if noisy:
            action = await acall_with_timeout(env.random_action, rng, timeout_s=timeout_s, what="env.random_action")
        token_ids = [*self.tokenizer.encode(reply(action), add_special_tokens=False), self.tokenizer.eos_token_id]
        if len(token_ids) > sampling.max_tokens:
            self._too_long[episode_id] = len(token_ids)
            raise GatewayError(400, "the expert's reply is over the token budget", "demo_too_long")
        return GenOutput(token_ids, [0.0] * len(token_ids), "stop", 0, [NOISY if noisy else 0] * len(token_ids))
